"""Training the embedded demo model on the synthetic caption task (issue F).

    demo_model_config  the tiny MiMo-V2.5-layout configs (text, vision, audio, processor)
    dataset            synthetic items -> the server's decode + preprocess -> cached tensors
    omni_trainer       the trainable composition (HF text model + our encoders) and its loss
    export             trained modules -> an omni checkpoint directory our loader serves
    train / evaluate   the CLIs
"""
