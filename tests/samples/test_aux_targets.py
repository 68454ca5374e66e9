"""Dense auxiliary training targets of the demo model (samples.training.aux_targets): the labels
must describe what the prepared tensors actually show, or deep supervision teaches the wrong thing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from encoders.image_processing import CLIP_MEAN, CLIP_STD
from samples.training.aux_targets import IGNORE, aux_targets, cell_owner, separator_ids
from samples.training.dataset import ItemPreparer, ItemRef
from samples.training.demo_model_config import DemoModelConfig
from samples.synthetic.generate import ItemJob, sample_spec, write_item
from samples.synthetic.spec import ShapeSpec


@pytest.fixture(scope="module")
def preparer() -> ItemPreparer:
    return ItemPreparer(DemoModelConfig())


def _prepared(preparer: ItemPreparer, tmp: Path, ref: ItemRef):
    label = write_item(ItemJob(ref.modality, ref.seed, ref.index, None, ref.max_video_seconds), tmp)
    item = preparer.prepare(tmp / label["path"], label["caption"])
    merge = DemoModelConfig().vision.spatial_merge_size
    return item, aux_targets(ref, item, merge, preparer.sampling, separator_ids(preparer.tokenizer))


def _token_saturation(rows: torch.Tensor) -> torch.Tensor:
    """Max - min channel (0..255) of each merged token's mean colour (rows: 4 patches per token)."""
    rgb = rows.float().view(-1, 3, 2, 16, 16).mean(dim=(2, 3, 4)) * torch.tensor(CLIP_STD) + torch.tensor(CLIP_MEAN)
    tok = rgb.view(-1, 4, 3).mean(1) * 255
    return tok.max(1).values - tok.min(1).values


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 60), st.integers(0, 60), st.integers(8, 40), st.sampled_from(["square", "circle", "triangle"]))
def test_cell_owner_marks_cells_deep_inside_and_nothing_far_outside(x, y, side, kind):
    shape = ShapeSpec(kind, "red", x, y, side)
    owner = cell_owner((shape,), 128, 128, 16, 16).view(16, 16)  # 8-px cells
    # A cell whose 4x4 sample points all lie in the box's inscribed core is the shape's.
    cx, cy = shape.interior_point
    r, c = int(cy // 8), int(cx // 8)
    if kind == "square" and x <= c * 8 and (c + 1) * 8 <= x + side and y <= r * 8 and (r + 1) * 8 <= y + side:
        assert owner[r, c] == 0
    # No cell entirely outside the bounding box belongs to it.
    for rr in range(16):
        for cc in range(16):
            outside = (cc + 1) * 8 <= x or cc * 8 >= x + side or (rr + 1) * 8 <= y or rr * 8 >= y + side
            if outside:
                assert owner[rr, cc] == -1


def test_image_targets_match_the_pixels_and_order_shapes_left_to_right(preparer, tmp_path):
    checked = 0
    for index in range(12):
        ref = ItemRef("image", 777, index)
        item, aux = _prepared(preparer, tmp_path, ref)
        colour, kind, inst = aux.colour[0], aux.kind[0], aux.instance[0]
        assert colour.shape[0] * 4 == item.units[0].shape[0]
        # Kind and instance are asked of shape tokens only.
        assert ((colour > 0) == (kind != IGNORE)).all() and ((colour > 0) == (inst != IGNORE)).all()
        assert (kind[colour > 0] > 0).all() and (inst[colour > 0] > 0).all()
        sat = _token_saturation(item.units[0])
        if (colour > 0).any():
            assert sat[colour > 0].mean() > 40, (ref, item.caption)  # partly covered cells: mixed with gray
        assert sat[colour == 0].mean() < 20, (ref, item.caption)
        # The text model's ordinal on the image placeholders: shape j (left to right) -> j - 1.
        s, e = item.spans[0]
        assert aux.ordinal[s:e].tolist() == torch.where(inst == IGNORE, IGNORE, inst - 1).tolist()
        assert (aux.ordinal[:s] == IGNORE).all() and (aux.ordinal[e:] == IGNORE).all()
        _, gh, gw = item.grids[0]
        cols = torch.arange(colour.shape[0]) % (gw // 2)
        if (inst == 2).any() and (inst == 1).any():
            assert cols[inst == 1].float().mean() < cols[inst == 2].float().mean()
            checked += 1
        # The first shape named in the caption is the leftmost one: its colour is instance 1's.
        names = ["red", "green", "blue", "yellow"]
        if (inst == 1).any():
            first = item.caption.split()[1]
            assert torch.mode(colour[inst == 1]).values.item() == names.index(first) + 1
    assert checked >= 2  # seed 777 has two-shape images among its first 12


def test_video_ordinals_step_through_the_colour_segments(preparer, tmp_path):
    for index in range(4):
        ref = ItemRef("video", 778, index, 8.0)
        item, aux = _prepared(preparer, tmp_path, ref)
        spec = sample_spec(ItemJob("video", 778, index, None, 8.0))
        per_group = [int(aux.ordinal[s]) for s, e in item.spans]
        assert all(int(aux.ordinal[s]) == int(aux.ordinal[e - 1]) for s, e in item.spans)
        assert per_group[0] == 0 and per_group[-1] == len(spec.colours) - 1
        assert all(0 <= b - a <= 1 for a, b in zip(per_group, per_group[1:]))
        # A change is flagged exactly on the groups whose segment differs from the previous group's.
        changes = [int(aux.change[s]) for s, e in item.spans]
        assert changes == [0] + [int(b != a) for a, b in zip(per_group, per_group[1:])]
        # Outside the video's pads nothing is asked of the text model.
        pads = torch.zeros(item.num_tokens, dtype=torch.bool)
        for s, e in item.spans:
            pads[s:e] = True
        assert (aux.ordinal[~pads] == IGNORE).all()
        assert (aux.group_colour[~pads] == IGNORE).all() and (aux.group_kind[~pads] == IGNORE).all()
        kind = ["circle", "square", "triangle"].index(spec.shape.kind) + 1
        for g, ((s, e), c) in enumerate(zip(item.spans, aux.colour)):
            shown = ["red", "green", "blue", "yellow"].index(spec.colours[per_group[g]]) + 1
            assert set(c.unique().tolist()) <= {0, shown}
            # Every placeholder of the group is asked the group's colour and kind, shape or not.
            assert aux.group_colour[s:e].tolist() == [shown] * (e - s)
            assert aux.group_kind[s:e].tolist() == [kind] * (e - s)


def test_audio_targets_follow_the_beeps(preparer, tmp_path):
    for index in range(6):
        ref = ItemRef("audio", 779, index)
        item, aux = _prepared(preparer, tmp_path, ref)
        spec = sample_spec(ItemJob("audio", 779, index, None, 60.0))
        pitch = aux.pitch[0]
        s, e = item.spans[0]
        assert pitch.shape[0] == e - s
        # Each beep (>= 150 ms, i.e. >= one 80 ms token centre) is labelled with its pitch, in order.
        runs = [int(p) for i, p in enumerate(pitch.tolist()) if p and (i == 0 or pitch[i - 1] != p)]
        want = [1 if b.pitch == "low" else 2 for b in spec.beeps]
        collapsed = [w for i, w in enumerate(want) if i == 0 or want[i - 1] != w]
        assert [r for i, r in enumerate(runs) if i == 0 or runs[i - 1] != r] == collapsed
        ordinal = aux.ordinal[s:e]
        assert int(ordinal[-1]) == len(spec.beeps) and (ordinal.diff() >= 0).all()
        assert int(aux.change[s:e].sum()) == len(spec.beeps)  # one onset token per beep
        # Beep tokens are louder than silent ones in the log-mel input (8 mel frames per token).
        mel = item.units[0]
        n = min(e - s, mel.shape[0] // 8)
        energy = mel[: n * 8].reshape(n, 8, mel.shape[1]).mean(dim=(1, 2))
        assert energy[:n][pitch[:n] > 0].mean() > energy[:n][pitch[:n] == 0].mean()


def test_a_videos_sound_rows_get_the_beeps_and_its_answer_restarts_the_count_at_the_beep_list(preparer, tmp_path):
    """A beeping video: its sound segments' rows carry each beep's pitch in order, the sound
    placeholders (laid out between the frame groups) count the beeps started by their time, and
    ``emitted`` counts the beep list's "," from "beeps:" on, not the colour list's " then"."""
    seps = separator_ids(preparer.tokenizer)
    for index in range(3):
        ref = ItemRef("beeping_video", 782, index, 8.0)
        item, aux = _prepared(preparer, tmp_path, ref)
        spec = sample_spec(ItemJob("beeping_video", 782, index, None, 8.0))
        assert item.sound and len(aux.sound_pitch) == len(item.sound)
        pitch = torch.cat(aux.sound_pitch)
        runs = [int(p) for i, p in enumerate(pitch.tolist()) if p and (i == 0 or pitch[i - 1] != p)]
        want = [1 if b.pitch == "low" else 2 for b in spec.beeps]
        def collapse(xs):
            return [x for i, x in enumerate(xs) if i == 0 or xs[i - 1] != x]
        assert collapse(runs) == collapse(want)
        # Sound placeholders in prompt order = time order: the beeps started never go down.
        sound_pos = torch.cat([torch.arange(s, e) for s, e, _, _ in sorted(item.sound_spans)])
        started = aux.ordinal[sound_pos]
        assert (started.diff() >= 0).all() and int(started[-1]) == len(spec.beeps)
        assert int(aux.change[sound_pos].sum()) == len(spec.beeps)
        # Each placeholder row's pitch target equals the pitch its own tower row is taught.
        for s, e, seg, row in item.sound_spans:
            assert aux.sound_pitch[seg][row:row + e - s].shape[0] == e - s
        answer = item.input_ids[item.answer_start:].tolist()
        colon = answer.index(seps[":"])
        for t in range(item.answer_start + colon, item.num_tokens - 1):
            closed = sum(1 for tok in answer[colon + 1:t + 1 - item.answer_start] if tok == seps["audio"])
            assert int(aux.emitted[t]) == min(closed, 3)
        semicolon = answer.index(seps[";"])
        assert (aux.emitted[item.answer_start + semicolon:item.answer_start + colon] == IGNORE).all()
        assert int(aux.emitted[item.answer_start + semicolon - 1]) == min(len(spec.colours) - 1, 3)


def test_aux_losses_train_heads_and_towers_and_stay_out_of_the_export(preparer, tmp_path):
    from samples.checkpoints.tiny_omni import tiny_special_tokens
    from samples.training.export import export_checkpoint
    from samples.training.omni_trainer import OmniTrainModel

    config = DemoModelConfig()
    refs = [ItemRef("image", 780, 0), ItemRef("audio", 780, 1), ItemRef("video", 780, 2, 4.0),
            ItemRef("beeping_video", 780, 3, 4.0)]
    pairs = [_prepared(preparer, tmp_path, r) for r in refs]
    items, aux = [p[0] for p in pairs], [p[1] for p in pairs]
    model = OmniTrainModel(config, pad_id=tiny_special_tokens().pad, seed=0)
    plain = model.loss(items)
    out = model.loss(items, aux, aux_weight=0.5)
    assert plain.aux == {}
    assert set(out.aux) == {"colour", "kind", "instance", "pitch", "ordinal", "change", "emitted",
                            "group_colour", "group_kind"}
    assert torch.isclose(out.loss, plain.loss + 0.5 * sum(torch.tensor(v) for v in out.aux.values()), atol=1e-4)
    out.loss.backward()
    for name, p in list(model.aux_heads.named_parameters()) + list(model.vision.named_parameters())[:2]:
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    ckpt = export_checkpoint(model, tmp_path / "ckpt")
    index = (ckpt / "model.safetensors.index.json").read_text()
    assert "aux" not in index and "visual." in index


@pytest.mark.parametrize("modality,index", [("image", 3), ("video", 5), ("audio", 7)])
def test_emitted_counts_the_list_items_the_answer_has_closed(preparer, tmp_path, modality, index):
    """At the position that predicts answer token t + 1, ``emitted`` = separators among answer
    tokens up to t: 0 while the first item is written, j after the j-th separator."""
    ref = ItemRef(modality, 781, index, 10.0)
    item, aux = _prepared(preparer, tmp_path, ref)
    sep = separator_ids(preparer.tokenizer)[modality]
    answer = item.input_ids[item.answer_start:].tolist()
    positions = (aux.emitted != IGNORE).nonzero().flatten().tolist()
    assert positions == list(range(item.answer_start - 1, item.num_tokens - 1))
    for t in positions:
        closed = sum(1 for tok in answer[: t + 1 - item.answer_start] if tok == sep)
        assert int(aux.emitted[t]) == min(closed, 3)
    items_in_caption = {"image": " and ", "video": ", then ", "audio": ", "}[modality]
    assert int(aux.emitted[item.num_tokens - 2]) == min(item.caption.count(items_in_caption), 3)


def test_tower_pretraining_fits_the_tower_targets_and_leaves_the_text_model_alone(preparer, tmp_path):
    import random

    from samples.checkpoints.tiny_omni import tiny_special_tokens
    from samples.training.omni_trainer import OmniTrainModel
    from samples.training.tower_pretrain import pretrain_towers

    refs = [ItemRef("image", 782, i) for i in range(3)] + [ItemRef("audio", 782, i) for i in range(2)]
    pairs = [_prepared(preparer, tmp_path, r) for r in refs]
    items, aux = [p[0] for p in pairs], [p[1] for p in pairs]
    model = OmniTrainModel(DemoModelConfig(), pad_id=tiny_special_tokens().pad, seed=0)
    text_before = {k: v.clone() for k, v in model.text.state_dict().items()}
    vision_before = [p.detach().clone() for p in model.vision.parameters()]

    def tower_loss() -> float:
        with torch.no_grad():
            vis = [(it.units[0], it.grids[0], a, 0) for it, a in zip(items, aux) if it.modality == "image"]
            aud = [(it.units[0], a) for it, a in zip(items, aux) if it.modality == "audio"]
            return float(sum(model.tower_loss(vis, aud).values()))

    before = tower_loss()
    steps = pretrain_towers(model, items, aux, seconds=None, steps=30, lr=4e-3, rng=random.Random(0),
                            vision_units=3, audio_clips=2, log_every=1000)
    assert steps == 30
    assert tower_loss() < 0.5 * before
    for k, v in model.text.state_dict().items():
        assert torch.equal(v, text_before[k]), k
    assert any(not torch.equal(p.detach(), b) for p, b in zip(model.vision.parameters(), vision_before))


def test_a_shape_smaller_than_a_cell_still_owns_the_cell_holding_it():
    tiny = ShapeSpec("circle", "red", 37, 70, 10)        # 10 px in 32-px cells: covers < 30 % of any
    big = ShapeSpec("square", "blue", 0, 0, 64)
    owner = cell_owner((big, tiny), 128, 128, 4, 4)
    assert (owner == 1).sum() == 1 and owner[2 * 4 + 1] == 1   # cell (row 2, col 1) holds the circle
    assert (owner == 0).sum() == 4                          # the square's 2x2 cells
