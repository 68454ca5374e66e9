"""Tensor and expert parallelism over torch.distributed (docs/parallelism.md).

parallel_context  which share a rank holds (heads per attention kind, vocab, experts) + collectives
parallel_layers   column / row / vocab-parallel linears and embedding the model layers are built from
expert_parallel   expert placement and the combine of the MoE block
rank_group        the processes and groups (spawn or torchrun; gloo on CPU, NCCL on CUDA)
step_ops          the messages rank 0 broadcasts per model call
step_mirror       rank 0's MirroredModel (the engine's model); worker: the other ranks' loop
launcher          load_text_model: one process or a parallel group, from EngineConfig's sizes
"""
