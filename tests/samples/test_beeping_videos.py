"""Beeping videos (the synthetic task with sound in videos): deterministic specs from their own
stream, a caption naming colours then beeps, an MP4 / WebM with a sound track whose beeps sit at
their specified times and pitches, and plain videos left as they were."""

from __future__ import annotations

import numpy as np
import pytest

from mm_pipeline.media.decode.audio import decode_audio
from mm_pipeline.media.types import MediaItem, MediaKind
from samples.synthetic.generate import generate
from samples.synthetic.sampler import sample_beeping_video, sample_video
from samples.synthetic.spec import PITCHES
from tests.support.paths import REPO

RATE = 24000


def test_specs_are_deterministic_and_plain_videos_unchanged():
    a, b = sample_beeping_video(5, 3, max_seconds=10), sample_beeping_video(5, 3, max_seconds=10)
    assert a == b and 1 <= len(a.beeps) <= 4
    assert a.caption == (f"a {a.shape.kind} that is " + ", then ".join(a.colours)
                         + "; beeps: " + ", ".join(x.pitch for x in a.beeps))
    plain = sample_video(5, 3, max_seconds=10)
    assert plain.beeps == () and ";" not in plain.caption
    for i in range(20):
        spec = sample_beeping_video(1, i, max_seconds=60)
        ends = [x.start_s + x.length_s for x in spec.beeps]
        assert all(e <= spec.duration_s for e in ends)
        assert all(nxt.start_s >= e for nxt, e in zip(spec.beeps[1:], ends))


@pytest.mark.parametrize("fmt", ["mp4", "webm"])
def test_files_carry_the_beeps_at_their_times(tmp_path, fmt):
    labels = generate(7, tmp_path, beeping_videos=2, max_video_seconds=6, video_format=fmt)
    for record in labels:
        assert record["modality"] == "video" and record["prompt"] == "Describe this video."
        assert record["path"].startswith("video_sound_") and "; beeps: " in record["caption"]
        data = (tmp_path / record["path"]).read_bytes()
        sound = decode_audio(MediaItem(MediaKind.VIDEO, fmt, data), RATE).samples.numpy()
        assert abs(len(sound) / RATE - record["duration_s"]) < 0.15
        for beep in record["beeps"]:
            a = int((beep["start_s"] + 0.03) * RATE)
            z = int((beep["start_s"] + beep["length_s"] - 0.03) * RATE)
            piece = sound[a:z]
            spectrum = np.abs(np.fft.rfft(piece))
            peak = np.fft.rfftfreq(len(piece), 1 / RATE)[spectrum.argmax()]
            assert abs(peak - PITCHES[beep["pitch"]]) < 30, (record["path"], beep)
            assert np.sqrt(np.mean(piece ** 2)) > 0.1
        # silence between beeps (codec noise aside)
        quiet = np.ones(len(sound), dtype=bool)
        for beep in record["beeps"]:
            quiet[max(0, int((beep["start_s"] - 0.05) * RATE)):int((beep["start_s"] + beep["length_s"] + 0.05) * RATE)] = False
        assert np.sqrt(np.mean(sound[quiet] ** 2)) < 0.02


# ---- training on them ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def beeping(tmp_path_factory):
    out = tmp_path_factory.mktemp("beep")
    (record,) = generate(11, out, beeping_videos=1, max_video_seconds=5, video_format="mp4")
    return out / record["path"], record


def test_training_prompt_of_a_beeping_video_equals_the_served_prompt(beeping):
    from llm_core.engine.sampling import SamplingParams
    from mm_pipeline.multimodal_llm import MultimodalLLM
    from samples.training.dataset import ItemPreparer
    from samples.training.demo_model_config import DemoModelConfig

    model = REPO / "samples" / "demo-model"
    if not (model / "config.json").is_file():
        pytest.skip("samples/demo-model not built")
    path, record = beeping
    item = ItemPreparer(DemoModelConfig()).prepare(path, record["caption"])
    assert item.sound and item.sound_spans  # the sound is part of the training prompt
    convo = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": f"file://{path}"}},
                                          {"type": "text", "text": record["prompt"]}]}]
    # video_audio=True (what the committed demo model declares; explicit so a silent checkpoint passed
    # here is still checked): the prompt a training run learns from must be the one served with sound on
    with MultimodalLLM(model, allowed_local_dirs=(str(path.parent),), video_audio=True) as llm:
        (out,) = llm.chat([convo], SamplingParams(max_tokens=1, temperature=0.0))
    assert list(out.prompt_token_ids) == item.input_ids[:item.answer_start].tolist()


def test_the_trainer_writes_sound_rows_into_their_slices(beeping):
    import torch

    from samples.checkpoints.tiny_omni import tiny_special_tokens
    from samples.training.dataset import ItemPreparer
    from samples.training.demo_model_config import DemoModelConfig
    from samples.training.omni_trainer import OmniTrainModel

    path, record = beeping
    config = DemoModelConfig()
    item = ItemPreparer(config).prepare(path, record["caption"])
    covered = sum(end - start for start, end, _, _ in item.sound_spans)
    assert covered == sum(config.audio.segment_tokens(int(m.shape[0])) for m in item.sound)
    torch.manual_seed(0)
    model = OmniTrainModel(config, pad_id=tiny_special_tokens().pad)
    out = model.loss([item])
    out.loss.backward()
    grads = [p.grad for p in model.audio.parameters() if p.grad is not None]
    assert grads and any(float(g.abs().sum()) > 0 for g in grads)  # the caption loss reaches the audio tower


def test_aux_targets_train_on_batches_with_beeping_videos(beeping, tmp_path):
    """The pitch targets cover audio clips' rows and a video's sound rows: a batch with a video's
    sound track and no clip, or with both, trains, and each item's rows meet their own targets
    (the pitch loss of the pair is the row-weighted mean of the two alone)."""
    import math

    import torch

    from samples.checkpoints.tiny_omni import tiny_special_tokens
    from samples.synthetic.generate import ItemJob, write_item
    from samples.training.aux_targets import aux_targets, separator_ids
    from samples.training.dataset import ItemPreparer, ItemRef
    from samples.training.demo_model_config import DemoModelConfig
    from samples.training.omni_trainer import OmniTrainModel

    config = DemoModelConfig()
    preparer = ItemPreparer(config)
    refs = [ItemRef("beeping_video", 11, 0, 5.0), ItemRef("audio", 11, 1)]
    items, aux = [], []
    for ref in refs:
        label = write_item(ItemJob(ref.modality, ref.seed, ref.index, None, ref.max_video_seconds), tmp_path)
        item = preparer.prepare(tmp_path / label["path"], label["caption"])
        items.append(item)
        aux.append(aux_targets(ref, item, config.vision.spatial_merge_size, preparer.sampling,
                               separator_ids(preparer.tokenizer)))
    assert items[0].sound
    model = OmniTrainModel(config, pad_id=tiny_special_tokens().pad)
    video = model.loss(items[:1], aux[:1], aux_weight=1.0)
    assert "pitch" in video.aux and math.isfinite(float(video.loss.detach()))
    clip = model.loss(items[1:], aux[1:], aux_weight=1.0)
    both = model.loss(items, aux, aux_weight=1.0)
    n_video = sum(int(t.shape[0]) for t in aux[0].sound_pitch)
    n_clip = int(aux[1].pitch[0].shape[0])
    want = (video.aux["pitch"] * n_video + clip.aux["pitch"] * n_clip) / (n_video + n_clip)
    torch.testing.assert_close(torch.tensor(both.aux["pitch"]), torch.tensor(want), rtol=1e-4, atol=1e-5)


def test_evaluation_scores_beeping_videos_as_their_own_group():
    from samples.training.evaluate import score

    labels = [{"path": "a.mp4", "modality": "video", "caption": "x; beeps: low", "duration_s": 40.0,
               "beeps": [{"pitch": "low"}]},
              {"path": "b.mp4", "modality": "video", "caption": "y", "duration_s": 40.0}]
    groups = score(labels, {"a.mp4": {"caption": "x"}, "b.mp4": {"caption": "y"}})
    assert groups["video+sound"]["n"] == 1 and groups["video+sound"]["correct"] == 0
    assert groups["video"]["correct"] == 1 and groups["video>=30s"]["n"] == 1
