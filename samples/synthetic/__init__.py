"""Synthetic caption task (issue F): seeded shapes-in-images, colour-changing videos, beep audio.

    from samples.synthetic import sample_image, write_image
    spec = sample_image(seed=0, index=3)     # parameters only
    spec.caption                             # e.g. 'a red circle and a blue square'
    write_image(spec, "/tmp/item.img")       # any path; the file format is spec.format

Whole data sets: ``samples.synthetic.generate.generate(...)`` or the CLI
``python -m samples.synthetic.generate --help`` (not imported here, so ``-m`` runs it cleanly).
"""

from samples.synthetic.audio_gen import synthesize, write_audio
from samples.synthetic.image_gen import render_image, write_image
from samples.synthetic.sampler import item_rng, sample_audio, sample_image, sample_video
from samples.synthetic.spec import AudioSpec, BeepSpec, ImageSpec, ShapeSpec, VideoSpec
from samples.synthetic.video_gen import render_colour_frames, write_video

__all__ = [
    "AudioSpec", "BeepSpec", "ImageSpec", "ShapeSpec", "VideoSpec",
    "item_rng", "render_colour_frames", "render_image",
    "sample_audio", "sample_image", "sample_video", "synthesize",
    "write_audio", "write_image", "write_video",
]
