"""The media pipeline, the omni engine, the OpenAI server, the CLI and jobs (README "The map")."""

from mm_pipeline.openmp_env import apply_defaults as _apply_openmp_defaults

_apply_openmp_defaults()  # before anything imports torch (mm_pipeline/openmp_env.py)
