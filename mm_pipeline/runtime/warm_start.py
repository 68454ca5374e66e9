"""What the runtime does once at start so that the first requests and later garbage collections
do not stall the event loop: import the modules the request path would import on first use, then
freeze every object alive (``OmniRuntime.start``; tests/mm_pipeline/runtime/test_warm_start.py)."""

from __future__ import annotations

import gc
import importlib

# Modules the request path imports on first use, found by diffing ``sys.modules`` around the first
# image + video request of a started runtime. An import runs with the GIL held (and the import
# lock): numpy.ma alone (``np.unique`` of frame sampling imports it) held it ~90 ms on the 2-core
# host, stalling the event loop of a fresh server under its first media burst. Imported at start
# instead (tests/mm_pipeline/runtime/test_warm_start.py keeps the list complete).
REQUEST_PATH_MODULES = ("numpy.ma", "PIL.BmpImagePlugin", "PIL.GifImagePlugin", "PIL.ImageChops",
                        "PIL.ImageSequence", "PIL.JpegImagePlugin", "PIL.PngImagePlugin", "PIL.PpmImagePlugin",
                        "av.subtitles.stream", "encodings.unicode_escape", "kernels.band_attention_ref",
                        "kernels.cpu.paged_attention")


def import_request_path_modules() -> None:
    """Import ``REQUEST_PATH_MODULES`` now (before ``freeze_startup_objects``, so they are frozen too)."""
    for name in REQUEST_PATH_MODULES:
        importlib.import_module(name)


def freeze_startup_objects() -> None:
    """Move every object alive now (model, tokenizer, libraries: ~400k objects) out of the garbage
    collector's reach. A full (generation 2) collection walks them all: measured 250 ms of CPU on
    the 2-core host, with every Python thread stopped -- the event-loop stalls of ~100 ms under media
    load were these collections. Frozen objects are never walked again; later garbage is still
    collected. Collect first, so no garbage of the start-up is frozen with them; ``shutdown``
    unfreezes (process-wide), so a stopped runtime's cycles can be collected."""
    gc.collect()
    gc.freeze()
