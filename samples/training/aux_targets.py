"""Dense auxiliary targets for training the demo model: what each encoder token and each media
position in the prompt *should* know, derived from the item's synthetic spec.

Why: the caption loss alone reaches the towers only through a few answer tokens per item, and a
tiny model trained for an hour on 2 CPU cores does not find the vision pathway from that signal
(measured: image/video losses sat at the caption prior for 2000 steps). Deep supervision -- a
linear probe head per target, trained jointly and dropped at export -- tells the towers and the
text model which features to build, so the caption loss only has to learn to *read* them:

    tower token     colour (bg + 4), shape kind, instance (leftmost / second)   images, videos
                    pitch (silence, low, high)                                 audio, a video's sound
    text, layer 2   change: this video group's colour differs from the previous group's / a beep
                    starts at this audio token (the sliding layers see both neighbours)
    text, layer 2   group colour / group kind: every placeholder of a video group holds the
                    group's shape colour and kind, not only the one or two tokens the shape
                    covers, so a later full layer can fetch a segment's colour from any of them
    text, layer 3   ordinal: which colour segment a video group belongs to / how many beeps have
                    started at an audio token (the full layer counts the changes before it) /
                    which shape (0 = leftmost) an image's shape token belongs to
                    (a beeping video's sound rows, laid out between its frame groups, get the
                    audio clip's pitch / change / ordinal by the time each row stands for)
                    emitted: at answer positions, how many list items (", then" / "," / " and")
                    the answer has already closed -- which item comes next; a beeping video's
                    answer holds two lists ("red, then blue; beeps: low, high"): the count
                    restarts at 0 after "beeps:" and counts "," from there

so a full-attention layer after layer 3 only has to match "emitted = j" against "ordinal = j".
The ordinal is the one quantity the towers cannot compute (a video tower sees one 1-s frame group),
so it is asked of the text model's hidden state. Kind and instance are asked of shape tokens only
(background is the colour target's job), so the rare shape tokens are not drowned out.

Geometry: a merged vision token covers a (merge*patch)^2 cell of the resized frame, which maps
linearly onto the original (smart_resize never crops); an 8x8 grid of sample points in the cell
decides which shape (if any) covers it: >= 30 % of the points, or the cell holding most of a shape
smaller than a cell. Audio tokens are 80 ms (hop 10 ms x conv 2 x pool 2 x group 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from samples.training.dataset import ItemRef, TrainItem
from mm_pipeline.media.decode.video_sampling import VideoSamplingParams, sample_frames
from samples.synthetic.generate import ItemJob, sample_spec
from samples.synthetic.spec import COLOURS, SHAPES, AudioSpec, ImageSpec, ShapeSpec, VideoSpec

IGNORE = -100
COLOUR_CLASSES = 1 + len(COLOURS)     # 0 = background
KIND_CLASSES = 1 + len(SHAPES)
INSTANCE_CLASSES = 3                  # 0 = background, 1 = leftmost shape, 2 = second shape
PITCH_CLASSES = 3                     # 0 = silence, 1 = low, 2 = high
ORDINAL_CLASSES = 5                   # video: segment 0..3; audio: beeps started 0..4
CHANGE_CLASSES = 2
EMITTED_CLASSES = 4                   # list items closed so far: 0..3
SEPARATORS = {"image": " and", "video": " then", "audio": ","}
BEEP_LIST = ":"                       # a beeping video's beep list starts after "; beeps:"
_COLOUR_ID = {c: i + 1 for i, c in enumerate(COLOURS)}
_KIND_ID = {k: i + 1 for i, k in enumerate(SHAPES)}
_PITCH_ID = {"low": 1, "high": 2}
_SAMPLES = 8                          # sample points per cell side (4 px apart in a 32-px cell)
_COVER = 0.3                          # a cell belongs to a shape covering >= 30 % of its points


@dataclass(frozen=True)
class AuxTargets:
    """Per-unit token targets (row order of the tower's output) and per-position text targets."""

    colour: list[torch.Tensor]        # vision units: [tokens] long; audio: empty
    kind: list[torch.Tensor]
    instance: list[torch.Tensor]
    pitch: list[torch.Tensor]         # audio units: [tokens] long; vision: empty
    sound_pitch: list[torch.Tensor]   # a video's sound segments: [rows] long; otherwise empty
    ordinal: torch.Tensor             # [num_tokens] long over input_ids, IGNORE where undefined
    change: torch.Tensor              # [num_tokens] long, IGNORE where undefined
    emitted: torch.Tensor             # [num_tokens] long, IGNORE outside the answer positions
    group_colour: torch.Tensor        # [num_tokens] long: video placeholders, IGNORE elsewhere
    group_kind: torch.Tensor          # [num_tokens] long: video placeholders, IGNORE elsewhere


def _inside(shape: ShapeSpec, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    s = float(shape.side)
    if shape.kind == "circle":
        cx, cy = shape.centre
        return (x - cx) ** 2 + (y - cy) ** 2 <= (s / 2) ** 2
    in_y = (y >= shape.y) & (y < shape.y + s)
    if shape.kind == "square":
        return in_y & (x >= shape.x) & (x < shape.x + s)
    # triangle, apex up at (x + s/2, y), base = height = s: half-width grows by 1/2 per pixel down
    return in_y & ((x - (shape.x + s / 2)).abs() <= (y - shape.y) / 2)


def cell_owner(shapes: tuple[ShapeSpec, ...], width: int, height: int, rows: int, cols: int) -> torch.Tensor:
    """[rows * cols] index into ``shapes`` of the shape covering each cell (raster order), -1 = none."""
    frac = (torch.arange(_SAMPLES, dtype=torch.float64) + 0.5) / _SAMPLES
    ys = ((torch.arange(rows, dtype=torch.float64)[:, None] + frac[None]) * height / rows)   # [rows, S]
    xs = ((torch.arange(cols, dtype=torch.float64)[:, None] + frac[None]) * width / cols)    # [cols, S]
    y = ys[:, None, :, None].expand(rows, cols, _SAMPLES, _SAMPLES)
    x = xs[None, :, None, :].expand(rows, cols, _SAMPLES, _SAMPLES)
    owner = torch.full((rows, cols), -1, dtype=torch.long)
    best = torch.zeros(rows, cols, dtype=torch.float64)
    covers = []
    for i, shape in enumerate(shapes):
        cover = _inside(shape, x, y).double().mean(dim=(2, 3))
        take = (cover >= _COVER) & (cover > best)
        owner[take], best[take] = i, cover[take]
        covers.append(cover.reshape(-1))
    owner = owner.reshape(-1)
    # A shape smaller than a cell (video frames shrink it to ~one 16-px patch: median side 14 px in
    # 60 s videos) still owns the free cell holding most of it, or it would be taught as background.
    for i, cover in enumerate(covers):
        if not (owner == i).any():
            free = cover.masked_fill(owner >= 0, 0.0)
            cell = int(free.argmax())
            if free[cell] > 0:
                owner[cell] = i
    return owner


def _vision_unit_targets(shapes: tuple[ShapeSpec, ...], colours: tuple[str, ...], width: int, height: int,
                         grid: tuple[int, int, int], merge: int) -> tuple[torch.Tensor, ...]:
    _, gh, gw = grid
    owner = cell_owner(shapes, width, height, gh // merge, gw // merge)
    lut_colour = torch.tensor([0] + [_COLOUR_ID[c] for c in colours])
    lut_kind = torch.tensor([0] + [_KIND_ID[s.kind] for s in shapes])
    lut_inst = torch.tensor([0] + list(range(1, len(shapes) + 1)))
    return lut_colour[owner + 1], lut_kind[owner + 1], lut_inst[owner + 1]


def _left_to_right(shapes: tuple[ShapeSpec, ...]) -> tuple[ShapeSpec, ...]:
    return tuple(sorted(shapes, key=lambda s: s.centre[0]))


def video_group_frames(spec: VideoSpec, groups: int, sampling: VideoSamplingParams) -> list[int]:
    """Source frame of each group's first sampled frame: the preparer's ``sample_frames`` on the
    spec's frame count (what the probe reports for our files); evenly spread if the counts differ."""
    indices = sample_frames(spec.n_frames, spec.fps, sampling).indices
    per = sampling.frame_factor
    if len(indices) == groups * per:
        return [min(indices[g * per], spec.n_frames - 1) for g in range(groups)]
    return [min(spec.n_frames - 1, round(g * spec.n_frames / groups)) for g in range(groups)]


def aux_targets(ref: ItemRef, item: TrainItem, merge: int, sampling: VideoSamplingParams,
                separator_ids: dict[str, int], audio_token_s: float = 0.08) -> AuxTargets:
    """Targets of one prepared item (``sampling``: the preparer's video frame sampling;
    ``separator_ids``: modality -> the token id of its list separator, see :data:`SEPARATORS`)."""
    spec = sample_spec(ItemJob(ref.modality, ref.seed, ref.index, None, ref.max_video_seconds))
    if spec.caption != item.caption:
        raise ValueError(f"{ref}: spec caption {spec.caption!r} != prepared caption {item.caption!r}")
    ordinal = torch.full((item.num_tokens,), IGNORE, dtype=torch.long)
    change = torch.full((item.num_tokens,), IGNORE, dtype=torch.long)
    group_colour = torch.full((item.num_tokens,), IGNORE, dtype=torch.long)
    group_kind = torch.full((item.num_tokens,), IGNORE, dtype=torch.long)
    colour, kind, instance, pitch, sound_pitch = [], [], [], [], []
    if isinstance(spec, ImageSpec):
        shapes = _left_to_right(spec.shapes)
        c, k, i = _vision_unit_targets(shapes, tuple(s.colour for s in shapes), spec.width, spec.height,
                                       item.grids[0], merge)
        colour, kind, instance = [c], [_shape_only(k, c)], [_shape_only(i, c)]
        # An image's "segments" are its shapes left to right: the same ordinal <-> emitted match
        # that fetches a video's j-th colour fetches the j-th shape here.
        start, end = item.spans[0]
        ordinal[start:end] = torch.where(i > 0, i - 1, IGNORE)
    elif isinstance(spec, VideoSpec):
        group_frames = video_group_frames(spec, len(item.units), sampling)
        previous = 0
        for g, ((start, end), frame) in enumerate(zip(item.spans, group_frames)):
            seg = spec.colour_index(frame)
            c, k, i = _vision_unit_targets((spec.shape,), (spec.colours[seg],), spec.width, spec.height,
                                           item.grids[g], merge)
            colour.append(c), kind.append(_shape_only(k, c)), instance.append(_shape_only(i, c))
            ordinal[start:end] = seg
            group_colour[start:end] = _COLOUR_ID[spec.colours[seg]]
            group_kind[start:end] = _KIND_ID[spec.shape.kind]
            change[start:end] = int(g > 0 and seg != previous)
            previous = seg
        sound_pitch = _video_sound_targets(spec, item, audio_token_s, ordinal, change)
    elif isinstance(spec, AudioSpec):
        if len(item.units) != 1:
            raise ValueError(f"{ref}: clips here are one segment, got {len(item.units)}")
        start, end = item.spans[0]
        p, started, onset = _beep_rows(spec.beeps, (torch.arange(end - start, dtype=torch.float64) + 0.5) * audio_token_s,
                                       audio_token_s)
        pitch = [p]
        ordinal[start:end], change[start:end] = started, onset
    # Position t predicts token t + 1: at t, the items closed so far are the separators in
    # input_ids[answer_start : t + 1].
    emitted = torch.full((item.num_tokens,), IGNORE, dtype=torch.long)
    answer = item.input_ids[item.answer_start:]
    closed = (answer == separator_ids[item.modality]).long().cumsum(0)  # a beeping video is a "video"
    emitted[item.answer_start - 1] = 0
    emitted[item.answer_start:item.num_tokens - 1] = closed[:-1].clamp(max=EMITTED_CLASSES - 1)
    if isinstance(spec, VideoSpec) and spec.beeps:
        _restart_at_beep_list(emitted, item, separator_ids)
    return AuxTargets(colour, kind, instance, pitch, sound_pitch, ordinal, change, emitted, group_colour, group_kind)


def _beep_rows(beeps, centre: torch.Tensor, token_s: float) -> tuple[torch.Tensor, ...]:
    """Per audio row (``centre``: the time it stands for, s): pitch (0 = silence), beeps started by
    then, and 1 where a beep started since the row before (one onset row per beep)."""
    p = torch.zeros(centre.shape[0], dtype=torch.long)
    started = torch.zeros(centre.shape[0], dtype=torch.long)
    before = torch.zeros(centre.shape[0], dtype=torch.long)
    for b in beeps:
        p[(centre >= b.start_s) & (centre < b.start_s + b.length_s)] = _PITCH_ID[b.pitch]
        started += (centre >= b.start_s).long()
        before += (centre - token_s >= b.start_s).long()
    return p, started, (started > before).long()


def _video_sound_targets(spec: VideoSpec, item: TrainItem, token_s: float, ordinal: torch.Tensor,
                         change: torch.Tensor) -> list[torch.Tensor]:
    """Pitch per row of each sound segment (tower targets), and ordinal / change on the sound
    placeholders; row r of segment s stands for the time after the rows of segments < s."""
    if not item.sound:
        return []
    rows = [0] * len(item.sound)  # every row of a segment is laid out in some span
    for start, end, seg, row in item.sound_spans:
        rows[seg] = max(rows[seg], row + end - start)
    offsets = torch.tensor([0] + rows[:-1]).cumsum(0).tolist()
    out = []
    for s, n in enumerate(rows):
        centre = (offsets[s] + torch.arange(n, dtype=torch.float64) + 0.5) * token_s
        out.append(_beep_rows(spec.beeps, centre, token_s)[0])
    for start, end, seg, row in item.sound_spans:
        centre = (offsets[seg] + row + torch.arange(end - start, dtype=torch.float64) + 0.5) * token_s
        _, started, onset = _beep_rows(spec.beeps, centre, token_s)
        ordinal[start:end], change[start:end] = started, onset
    return out


def _restart_at_beep_list(emitted: torch.Tensor, item: TrainItem, separator_ids: dict[str, int]) -> None:
    """A beeping video's answer: from the position of "beeps:"'s colon on, ``emitted`` counts the
    beep list's "," separators (as an audio clip's answer does); the positions that write "; beeps"
    are not asked (neither list's count describes them)."""
    answer = item.input_ids[item.answer_start:]
    colon = (answer == separator_ids[BEEP_LIST]).nonzero().flatten()
    semicolon = (answer == separator_ids[";"]).nonzero().flatten()
    if not len(colon) or not len(semicolon):
        raise ValueError(f"a beeping video's caption has no '; beeps:' part: {item.caption!r}")
    k, j = int(colon[0]), int(semicolon[0])
    commas = (answer[k + 1:] == separator_ids["audio"]).long().cumsum(0)
    base = item.answer_start + k  # the position that predicts the first pitch
    emitted[item.answer_start + j:base] = IGNORE
    emitted[base] = 0
    emitted[base + 1:item.num_tokens - 1] = commas[:-1].clamp(max=EMITTED_CLASSES - 1)


def _shape_only(target: torch.Tensor, colour: torch.Tensor) -> torch.Tensor:
    return target.masked_fill(colour == 0, IGNORE)


def separator_ids(tokenizer) -> dict[str, int]:
    """Modality -> the single token id of its list separator under ``tokenizer`` (plus ":" and ";",
    which open and precede a beeping video's beep list)."""
    out = {}
    for modality, text in {**SEPARATORS, BEEP_LIST: BEEP_LIST, ";": ";"}.items():
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"separator {text!r} is {len(ids)} tokens under this tokenizer; need one")
        out[modality] = ids[0]
    return out
