"""A started runtime has imported what its request path needs: the first image, video and audio
requests of a fresh process import no module (an import holds the GIL; numpy.ma alone stalled the
event loop ~90 ms under the first media burst). Run in a fresh interpreter, where nothing else
imported them before."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.support.paths import REPO

SCRIPT = textwrap.dedent("""
    import asyncio, base64, json, sys, tempfile
    from pathlib import Path
    from tests.support.media_samples import audio_bytes, image_bytes, video_bytes
    from llm_core import SamplingParams
    from mm_pipeline.runtime.omni_engine import OmniEngine, OmniEngineConfig
    from samples.checkpoints.tiny_omni import build_tiny_omni_checkpoint

    ckpt = build_tiny_omni_checkpoint(Path(tempfile.mkdtemp()) / "m")
    engine = OmniEngine.from_pretrained(ckpt, OmniEngineConfig.from_kwargs(
        page_size=4, num_full_tokens=4096, num_swa_tokens=2048))
    before = set(sys.modules)

    def part(kind, data):
        return {"type": f"{kind}_url", f"{kind}_url": {"url": "data:;base64," + base64.b64encode(data).decode()}}

    async def main():
        for p in (part("image", image_bytes("PNG")), part("image", image_bytes("JPEG")),
                  part("video", video_bytes(n_frames=20)), part("audio", audio_bytes())):
            msgs = [{"role": "user", "content": [p, {"type": "text", "text": "Describe."}]}]
            async for _ in engine.generate(msgs, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)):
                pass

    asyncio.run(main())
    engine.shutdown()
    print(json.dumps(sorted(set(sys.modules) - before)))
""")


def test_first_media_requests_import_nothing() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    imported = out.stdout.strip().splitlines()[-1]
    assert imported == "[]", f"imported on the request path (add to REQUEST_PATH_MODULES): {imported}"
