"""Where the repository and its committed samples are, for tests at any folder depth."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SAMPLE_MEDIA = REPO / "samples" / "media"
DEMO_MODEL = REPO / "samples" / "demo-model"
