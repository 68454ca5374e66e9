"""Prompt layout (docs/model.md §5): expand each media placeholder of a templated prompt into its
final token run, sized from media metadata *before* anything is encoded (unit sizes are
``encoders.config.unit_tokens``, counted by the planner; ``ChatLayout`` renders a parsed chat).

The chat template emits one pad per media item; :meth:`PromptLayout.expand` rewrites token ids:

    image:  <vs> <image_pad> <ve>  ->  <vs> <image_pad> x n <ve>
    video:  <vs> <video_pad> <ve>  ->  <video_start> ("MM:SS" <vs> <video_pad> x n <ve>) per group <video_end>
    video with its sound track (the reference's ``video_audio`` layout, docs/model.md §5.3):
                                   ->  <video_start> ("MM:SS" <vs> <video_pad> x n <ve> <as> <audio_pad> x L_k <ae>)
                                       per group k <video_end>
    audio:  <as> <audio_pad> <ae>  ->  <as> <audio_pad> x (sum over segments) <ae>

and returns, per media item, one [start, end) span per *unit* (image: 1; video: one per frame group;
audio: one per segment) -- the rows each unit's embeddings replace:

    ... <video_start> 0 0 : 0 0 <vs> [P P P P] <ve> 0 0 : 0 2 <vs> [P P P P] <ve> <video_end> ...
                                     \\unit 0/                        \\unit 1/

The "MM:SS" text of each group is left out when the checkpoint's ``use_video_timestamps`` is false.
Placeholders and media items pair up in order and must agree in kind and number.

A video's sound is interleaved by time (:func:`audio_slices`): group k takes the audio tokens
``[int(t_k * r), int(t_{k+1} * r))`` of the whole track (r = audio tokens per second, 6.25 for
MiMo-V2.5), the last group the rest of the track; a group whose slice is empty gets no audio block.
The sound's encoder units stay whole segments (cached and encoded as for an audio item), so a slice
may hold the end of one segment and the start of the next: it is then two spans, one per segment,
side by side. ``LaidOutPrompt.span_units`` says which unit (and which of its rows) fills each span.

It also names the prompt's *boundaries*: the position after each media item's closing token and
after each chat message's ``<|im_end|>``. The engine keeps a window of sliding-window KV there
(``LLMEngine.add_request(checkpoints=...)``, docs/kv_cache.md §7), so a new question about the same
media, the next turn of a conversation or another chat with the same system prompt resumes at the
last boundary it shares instead of at the start:

    <im_start>system ...<im_end> <im_start>user <vs>[P P P P]<ve> Describe it.<im_end> <im_start>assistant
                               ^                              ^                 ^
                         message end                     media end         message end

The text of messages is plain text (:class:`ChatTemplate`): a special token spelled in it
("<|vision_start|>", "<|im_end|>") is tokenized as the characters it is, so a client can neither
forge a media placeholder or a turn nor break one; only the chat template's own markup yields
special tokens. And a chat that cannot fit the context limit fails before it is templated
(:meth:`ChatLayout.check_markup`, text_bound.TextBound): every message costs at least the special
tokens of its markup, measured from the template once.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from encoders.video import format_timestamp
from mm_pipeline.errors import ContextLengthError
from mm_pipeline.model.config import SpecialTokens
from mm_pipeline.prompt.chat_template import ChatTemplate, chat_messages
from mm_pipeline.prompt.messages import ChatRequest
from mm_pipeline.prompt.template_options import TemplateOptions
from mm_pipeline.prompt.text_bound import TextBound

MEDIA_KINDS = ("image", "video", "audio")


def audio_slices(timestamps: Sequence[float], total: int, per_second: float) -> tuple[int, ...]:
    """Audio tokens laid after each video frame group: group k covers ``[int(t_k * per_second),
    int(t_{k+1} * per_second))`` of the track's ``total`` tokens, the last group the rest (module doc)."""
    if per_second <= 0:
        raise ValueError(f"audio tokens per second must be positive, got {per_second}")
    if not timestamps:
        return ()
    # the first group starts the track (its first frame is at 0 s in a sampled video), so the
    # slices cover every token once: they sum to ``total``
    bounds = [0] + [min(total, max(0, int(t * per_second))) for t in timestamps[1:]] + [total]
    for i in range(1, len(bounds)):
        bounds[i] = max(bounds[i], bounds[i - 1])  # repeated (padded) timestamps: an empty slice
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


@dataclass(frozen=True)
class MediaSlots:
    """How many placeholder tokens each unit of one media item takes (+ video group timestamps).

    A video with sound: ``unit_tokens`` are its frame groups', ``audio_tokens`` its sound segments'
    (units ``len(unit_tokens)`` onwards) and ``audio_per_second`` the rate that slices the sound by
    time (:func:`audio_slices`)."""

    kind: str
    unit_tokens: tuple[int, ...]
    timestamps: tuple[float, ...] = ()
    audio_tokens: tuple[int, ...] = ()
    audio_per_second: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in MEDIA_KINDS:
            raise ValueError(f"unknown media kind {self.kind!r}; expected one of {MEDIA_KINDS}")
        if not self.unit_tokens or any(n <= 0 for n in self.unit_tokens):
            raise ValueError(f"{self.kind} needs at least one unit, each with > 0 tokens, got {self.unit_tokens}")
        if self.kind == "image" and len(self.unit_tokens) != 1:
            raise ValueError(f"an image is one unit, got {len(self.unit_tokens)}")
        if self.kind == "video" and len(self.timestamps) != len(self.unit_tokens):
            raise ValueError(f"video has {len(self.unit_tokens)} groups but {len(self.timestamps)} timestamps")
        if self.audio_tokens and (self.kind != "video" or self.audio_per_second <= 0
                                  or any(n <= 0 for n in self.audio_tokens)):
            raise ValueError("only a video carries a sound track, with > 0 tokens per segment and a positive rate")

    @property
    def num_tokens(self) -> int:
        return sum(self.unit_tokens) + sum(self.audio_tokens)


@dataclass(frozen=True)
class LaidOutPrompt:
    token_ids: tuple[int, ...]
    unit_spans: tuple[tuple[tuple[int, int], ...], ...]  # per media item, per span: [start, end)
    boundaries: tuple[int, ...] = ()  # sorted positions after media items and message ends (module doc)
    # per media item, per span: (unit index, first row of that unit it takes); empty for an item
    # whose span i is simply unit i (everything but a video with sound)
    span_units: tuple[tuple[tuple[int, int], ...], ...] = ()

    def pieces(self, item: int) -> tuple[tuple[int, int], ...]:
        """(unit index, first row) of each span of media item ``item``."""
        own = self.span_units[item] if self.span_units else ()
        return own or tuple((i, 0) for i in range(len(self.unit_spans[item])))


class PromptLayout:
    """Expands placeholders with the ids of one checkpoint; ``encode_text`` tokenizes timestamps,
    which precede each video group only with ``video_timestamps`` (processor_config
    ``use_video_timestamps``)."""

    # media items whose token runs are remembered (MediaSlots -> tokens, spans): a repeat or a new
    # question about the same video lays out the same run again, and its "MM:SS" timestamps were one
    # tokenizer call per frame group (~0.1 ms of a same-prefix request for 6 groups)
    REMEMBERED_RUNS = 256

    def __init__(self, special: SpecialTokens, encode_text: Callable[[str], list[int]],
                 video_timestamps: bool = True) -> None:
        self.special = special
        self.encode_text = encode_text
        self.video_timestamps = video_timestamps
        self._runs: OrderedDict[tuple[MediaSlots, bool], tuple[tuple[int, ...], tuple, tuple]] = OrderedDict()
        self._runs_lock = threading.Lock()  # layouts run on several worker threads
        self._template: ChatTemplate | None = None  # of the tokenizer ``render`` was given last

    @classmethod
    def from_tokenizer(cls, special: SpecialTokens, tokenizer: Any, video_timestamps: bool = True) -> "PromptLayout":
        return cls(special, lambda text: list(tokenizer.encode(text, add_special_tokens=False)), video_timestamps)

    def expand(self, token_ids: Sequence[int], media: Sequence[MediaSlots]) -> LaidOutPrompt:
        """Rewrite one-pad placeholders of ``token_ids`` for ``media`` (in order)."""
        ids = list(token_ids)
        out: list[int] = []
        spans: list[tuple[tuple[int, int], ...]] = []
        units: list[tuple[tuple[int, int], ...]] = []
        ends: list[int] = []  # after each message's <im_end> and each media item's closing token
        sp = self.special
        # only a placeholder's start or a message's end changes anything: jump from one to the next
        # and copy the text between as slices (a Python step per token took 2.1 ms for a 10k-token
        # prompt, now 0.42; the same-prefix request's ~130 tokens 42 -> 22 us)
        marks = {sp.vision_start, sp.audio_start, sp.im_end}
        i = 0
        for at in [j for j, t in enumerate(ids) if t in marks]:
            if at < i:  # inside the placeholder just expanded
                continue
            out.extend(ids[i:at])
            if ids[at] == sp.im_end:
                out.append(sp.im_end)
                ends.append(len(out))
                i = at + 1
                continue
            kind, end = self._placeholder_at(ids, at)
            k = len(spans)
            if k >= len(media):
                raise ValueError(f"the prompt has more media placeholders than the {len(media)} media items given")
            item = media[k]
            if item.kind != kind:
                raise ValueError(f"placeholder {k} is for {kind} but media item {k} is {item.kind}")
            item_spans, item_units = self._emit_remembered(item, out)
            spans.append(item_spans)
            units.append(item_units)
            ends.append(len(out))
            i = end
        out.extend(ids[i:])
        if len(spans) != len(media):
            raise ValueError(f"{len(media)} media items but {len(spans)} placeholders in the prompt")
        return LaidOutPrompt(tuple(out), tuple(spans), tuple(ends),
                             tuple(units) if any(units) else ())

    def render(self, tokenizer: Any, messages: list[dict[str, Any]], media: Sequence[MediaSlots],
               *, add_generation_prompt: bool = True, **template_kwargs: Any) -> LaidOutPrompt:
        """Chat template -> token ids (message text literal, :class:`ChatTemplate`) -> expanded layout."""
        template = self._template
        if template is None or template.tokenizer is not tokenizer:
            template = self._template = ChatTemplate(tokenizer)
        return self.expand(template.token_ids(messages, add_generation_prompt=add_generation_prompt,
                                              **template_kwargs), media)

    # ---- internals -------------------------------------------------------------------------------
    def _placeholder_at(self, ids: list[int], i: int) -> tuple[str, int]:
        """(kind, index after the placeholder) of the one starting at ``ids[i]`` (a vision or audio
        start token); ValueError when it is not start, one kind of pad, end."""
        sp = self.special
        if ids[i] == sp.vision_start:
            closer, pads = sp.vision_end, {sp.image_pad: "image", sp.video_pad: "video"}
        else:
            closer, pads = sp.audio_end, {sp.audio_pad: "audio"}
        j = i + 1
        while j < len(ids) and ids[j] in pads and ids[j] == ids[i + 1]:
            j += 1
        if j == i + 1 or j >= len(ids) or ids[j] != closer:
            raise ValueError(f"malformed media placeholder at token {i}: expected start, one kind of pad, end "
                             f"(got {ids[i:i + 4]})")
        return pads[ids[i + 1]], j + 1

    def _emit_remembered(self, item: MediaSlots, out: list[int]
                         ) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
        """``_emit`` through the remembered runs: the run depends on nothing but ``item`` and this
        layout's ids, tokenizer and ``video_timestamps`` (in the key). Spans are kept relative to the
        run's start; a run that fails (a tokenizer error) is not remembered."""
        key = (item, self.video_timestamps)
        with self._runs_lock:
            run = self._runs.get(key)
            if run is not None:
                self._runs.move_to_end(key)
        if run is None:
            tokens: list[int] = []
            spans, units = self._emit(item, tokens)
            run = (tuple(tokens), spans, units)
            with self._runs_lock:
                self._runs[key] = run
                while len(self._runs) > self.REMEMBERED_RUNS:
                    self._runs.popitem(last=False)
        tokens, spans, units = run
        at = len(out)
        out.extend(tokens)
        return tuple((a + at, b + at) for a, b in spans), units

    def _emit(self, item: MediaSlots, out: list[int]
              ) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
        """Append ``item``'s tokens; its spans, and (unit, first row) per span when span i is not
        simply unit i (a video with sound), else ()."""
        sp = self.special
        spans = []
        if item.kind == "image":
            out.append(sp.vision_start)
            spans.append(self._pads(out, sp.image_pad, item.unit_tokens[0]))
            out.append(sp.vision_end)
        elif item.kind == "video":
            groups = len(item.unit_tokens)
            slices = (audio_slices(item.timestamps, sum(item.audio_tokens), item.audio_per_second)
                      if item.audio_tokens else (0,) * groups)
            # where each sound segment starts in the track's token sequence
            seg_starts = [0]
            for n in item.audio_tokens:
                seg_starts.append(seg_starts[-1] + n)
            units: list[tuple[int, int]] = []
            cursor = 0  # next audio token of the track
            out.append(sp.video_start)
            for g, (n, ts, take) in enumerate(zip(item.unit_tokens, item.timestamps, slices)):
                if self.video_timestamps:
                    out.extend(self.encode_text(format_timestamp(ts)))
                out.append(sp.vision_start)
                spans.append(self._pads(out, sp.video_pad, n))
                units.append((g, 0))
                out.append(sp.vision_end)
                if take:
                    out.append(sp.audio_start)
                    end = cursor + take
                    while cursor < end:  # one span per sound segment the slice touches
                        seg = bisect.bisect_right(seg_starts, cursor) - 1
                        piece = min(end, seg_starts[seg + 1]) - cursor
                        spans.append(self._pads(out, sp.audio_pad, piece))
                        units.append((groups + seg, cursor - seg_starts[seg]))
                        cursor += piece
                    out.append(sp.audio_end)
            out.append(sp.video_end)
            return tuple(spans), (tuple(units) if item.audio_tokens else ())
        else:
            out.append(sp.audio_start)
            for n in item.unit_tokens:
                spans.append(self._pads(out, sp.audio_pad, n))
            out.append(sp.audio_end)
        return tuple(spans), ()

    @staticmethod
    def _pads(out: list[int], pad: int, n: int) -> tuple[int, int]:
        start = len(out)
        out.extend([pad] * n)
        return start, start + n


class PlannedMedia(Protocol):
    """What the layout needs of one planned media item (mm_pipeline.encode.plan.MediaPlan)."""

    @property
    def slots(self) -> MediaSlots: ...


class ChatLayout:
    """Chat turns + planned media -> token ids with one placeholder span per encoder unit.

    The checkpoint's chat template renders each media part as one pad (kind from the *sniffed*
    media, so ``file`` parts work); :class:`PromptLayout` expands the pads to the sizes the plans
    found (cache manifest or metadata) -- all before any media is encoded.
    """

    def __init__(self, special: SpecialTokens, tokenizer: Any, video_timestamps: bool = True) -> None:
        self.tokenizer = tokenizer
        self.prompt_layout = PromptLayout.from_tokenizer(special, tokenizer, video_timestamps)
        self.template = ChatTemplate(tokenizer)
        self.prompt_layout._template = self.template  # one template (its probes) for both entry points
        self.text_bound = TextBound(tokenizer)

    def check_markup(self, turns: int, max_tokens: int | None, media_tokens: int = 0,
                     options: TemplateOptions | None = None) -> int:
        """``ContextLengthError`` when ``turns`` messages (and ``media_tokens`` of media) surely do
        not fit ``max_tokens`` with one generated token, as the runtime's exact check after layout
        would find: costs nothing, so a chat of a million empty messages fails before it is
        templated (seconds and gigabytes, measured). Returns the least tokens they take, templated
        with ``options`` (None: the least over every option)."""
        if max_tokens is None:
            return 0
        least = self.template.min_tokens(turns, options) + media_tokens
        if least + 1 > max_tokens:
            media = f" and {media_tokens} of media" if media_tokens else ""
            raise ContextLengthError(f"the chat's {turns} messages take at least {least} tokens of chat markup"
                                     f"{media}; with one generated token that exceeds the context limit of "
                                     f"{max_tokens} tokens")
        return least

    def render(self, chat: ChatRequest, plans: Sequence[PlannedMedia], max_tokens: int | None = None
               ) -> LaidOutPrompt:
        """Token ids, per plan its unit spans, and the boundaries, for a chat whose media planned as
        ``plans``. ``max_tokens`` (the context limit): a chat that cannot fit fails before it is
        templated and tokenized whole (``check_markup``, then ``TextBound`` for its text, reasoning
        included). The chat's ``TemplateOptions`` say how it is templated; its
        ``chat_template_kwargs`` are checked against the template first (``check_kwargs``)."""
        options = chat.options
        self.template.check_kwargs(options.kwargs)
        slots = [p.slots for p in plans]
        least = self.check_markup(len(chat.turns), max_tokens, sum(s.num_tokens for s in slots), options)
        self.text_bound.check(chat.texts, max_tokens, least)
        messages = chat_messages(chat, iter(s.kind for s in slots), keep_empty=not self.template.drops_empty_text)
        ids = self.template.token_ids(messages, add_generation_prompt=options.add_generation_prompt,
                                      continue_final_message=options.continue_final_message, tools=options.tools,
                                      **options.kwargs)
        return self.prompt_layout.expand(ids, slots)
