"""Media decoding: images, audio and video frames (sampling, chunks from their own seek point,
the decoded-bytes budget), on worker threads or processes (backend.py), and early while an
http(s) body still arrives (early.py: videos, and the starter of both; early_audio.py)."""
