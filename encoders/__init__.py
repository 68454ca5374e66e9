"""Media encoders: the MiMo-V2.5 vision tower (images and video frame groups), two audio encoders
(ours, and the MiMo-V2.5 reference RVQ path),
pixel / log-mel preprocessing and packed variable-length batching. Imports only :mod:`kernels`.

Entry points: :class:`encoders.vision.tower.VisionTransformer`, :class:`encoders.audio.encoder.AudioEncoder`,
:class:`encoders.audio.mimo_audio.MimoAudioEncoder`,
:mod:`encoders.image_processing`, :mod:`encoders.video`, :class:`encoders.audio.mel.LogMelSpectrogram`,
:mod:`encoders.weights` (safetensors by checkpoint name).
"""
