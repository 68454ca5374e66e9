"""Command-line flags generated from the config dataclasses, and ``--config FILE``.

One source of truth: every field of ``OmniEngineConfig`` becomes a flag, and so does every field of
the configs nested in it -- ``EngineConfig`` under its own names, ``MediaLimits`` as ``--media-*`` and
``VideoSamplingParams`` as ``--video-*`` -- named as ``OmniEngineConfig.from_kwargs`` takes them
(``media_max_bytes``), so flags, ``--config`` keys and Python keyword arguments are one set of names.
A field added to any of them is a flag without further work.

    field                              flag                           from the annotation
    max_num_seqs: int = 64             --max-num-seqs N               int (``*_bytes``: 8GiB, 512M ok)
    max_model_len: int | None = None   --max-model-len N              Optional: "none" gives None
    policy: Literal["a", "b"] = "a"    --policy {a,b}                 the Literal's values only
    enable_prefix_caching: bool        --[no-]enable-prefix-caching   BooleanOptionalAction
    allowed_domains: tuple[str, ...]   --allowed-domains HOST         repeatable, one value per use

The help text is the field's attribute docstring (the string literal under the field, read from the
source with ``ast``). A value is checked when argparse reads it, by building the field's dataclass
with it, so a bad one is a usage error (exit 2) that names the flag. Flags left out are absent from
the namespace (``SUPPRESS``): the dataclass defaults apply.

Variadic tuples take one value per use, not ``nargs="+"``, so a flag written before ``mmserve
caption``'s positional inputs does not swallow them.

``--config FILE`` (YAML or JSON, a mapping of option names with ``-`` or ``_``): the file's entries
become flags unless the command line gives that option itself, so explicit flags win; an unknown key
is a usage error naming it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import json
import re
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

_DEST_PREFIX = "config__"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class ConfigFlag:
    """One config field as a command-line flag."""

    owner: type  # the dataclass that declares the field
    name: str  # the field's name in ``owner``
    flat: str  # its name for OmniEngineConfig.from_kwargs ("max_num_seqs", "media_max_bytes")
    kind: type  # int, float, str or bool
    optional: bool  # ``X | None``
    repeated: bool  # ``tuple[X, ...]``
    default: Any
    doc: str
    choices: tuple = ()  # a Literal field's values

    @property
    def option(self) -> str:
        return "--" + self.flat.replace("_", "-")

    @property
    def dest(self) -> str:
        return _DEST_PREFIX + self.flat

    def convert(self, text: str) -> Any:
        """One command-line value -> the field's type, checked by the field's dataclass."""
        if self.optional and text.strip().lower() in ("none", "null"):
            value = None
        else:
            try:
                value = parse_scalar(self.kind, text, size=self.name.endswith("_bytes"))
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None
        if self.choices and value not in self.choices:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(map(str, self.choices))}, got {text!r}")
        self.check(value)
        return value

    def check(self, value: Any) -> None:
        """Build the field's dataclass with ``value`` (defaults elsewhere): its own validation runs.
        A problem that names another of its fields is a combination (``max_upload_bytes <=
        max_files_total_bytes``), which the other flags given may well satisfy: it is left to the
        build of the whole config from every flag (a usage error there), not refused here against
        the other fields' defaults."""
        try:
            dataclasses.replace(_default_of(self.owner), **{self.name: (value,) if self.repeated else value})
        except (ValueError, TypeError) as exc:
            named = set(re.split(r"\W+", str(exc)))
            if any(f.name in named for f in dataclasses.fields(self.owner) if f.name != self.name):
                return
            raise argparse.ArgumentTypeError(str(exc)) from None


def parse_scalar(kind: type, text: str, *, size: bool = False) -> Any:
    """``text`` as ``kind``; sizes (``size=True``) also take K/M/G/T suffixes, binary (``8GiB`` = ``8G``)."""
    if kind is int:
        m = _SIZE.match(text) if size else None
        if m and (m.group(2) or m.group(3)):
            scale = 1 << (10 * "_kmgt".index(m.group(2).lower() or "_")) if m.group(2) else 1
            return int(float(m.group(1)) * scale)
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"expected an integer{' or a size like 8GiB' if size else ''}, got {text!r}") from None
    if kind is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
    return text


def config_flags(root: type | None = None, nested: dict[str, str] | None = None) -> list[ConfigFlag]:
    """Every field of ``root`` and of its nested configs, as flags. ``nested``: field of ``root``
    holding a config -> the prefix of its fields' flat names ("" = their own names). Default:
    ``OmniEngineConfig`` with ``engine`` unprefixed and its ``NESTED_CONFIGS`` prefixes."""
    if root is None:
        from mm_pipeline.runtime.config import NESTED_CONFIGS, OmniEngineConfig

        root = OmniEngineConfig
        nested = {"engine": "", **{group: prefix for group, (prefix, _) in NESTED_CONFIGS.items()}}
    nested = nested or {}
    flags: list[ConfigFlag] = []
    for f, hint in _fields_with_hints(root):
        if f.name in nested:
            inner = _strip_optional(hint)[0]
            prefix = f"{nested[f.name]}_" if nested[f.name] else ""
            flags += [_flag(inner, g, ghint, prefix) for g, ghint in _fields_with_hints(inner)]
        else:
            flags.append(_flag(root, f, hint, ""))
    return flags


def add_config_flags(parser: argparse.ArgumentParser | Any, flags: Sequence[ConfigFlag],
                     aliases: dict[str, Sequence[str]] | None = None,
                     help_notes: dict[str, str] | None = None) -> None:
    """Add ``flags`` to ``parser`` (or an argument group). ``aliases``: flat name -> extra option
    strings kept for old spellings; ``help_notes``: flat name -> text replacing the default shown."""
    aliases, help_notes = aliases or {}, help_notes or {}
    for flag in flags:
        names = [flag.option, *aliases.get(flag.flat, ())]
        note = help_notes.get(flag.flat, "" if "default:" in flag.doc else f"default: {_show(flag)}")
        help_text = (f"{flag.doc.rstrip('.')} ({note})" if note else flag.doc).replace("%", "%%")
        if flag.kind is bool and not flag.repeated:
            parser.add_argument(*names, dest=flag.dest, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(*names, dest=flag.dest, type=flag.convert, default=argparse.SUPPRESS,
                                action="append" if flag.repeated else "store", help=help_text,
                                metavar="{" + ",".join(map(str, flag.choices)) + "}" if flag.choices else _metavar(flag))


def field_type(owner: type, name: str) -> Callable[[str], Any]:
    """An argparse ``type`` for a hand-written flag that sets the field ``name`` of the dataclass
    ``owner``: the value is parsed and checked as a generated flag's is, so a bad one is a usage
    error naming the flag, not a failure once the job runs."""
    f, hint = next((f, hint) for f, hint in _fields_with_hints(owner) if f.name == name)
    return _flag(owner, f, hint, "").convert


def config_values(args: argparse.Namespace, flags: Sequence[ConfigFlag]) -> dict[str, Any]:
    """The flags given, by flat name (``OmniEngineConfig.from_kwargs(**values)`` builds the config)."""
    values = {f.flat: getattr(args, f.dest) for f in flags if hasattr(args, f.dest)}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}


# ---- --config FILE -----------------------------------------------------------------------------

def add_config_file_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="YAML or JSON file of option names -> values (e.g. max_num_seqs: 8); "
                             "flags given on the command line win over it")


def config_file_args(path: str, parser: argparse.ArgumentParser, explicit: Sequence[str]) -> list[str]:
    """The entries of the config file at ``path`` as ``parser``'s flags, leaving out options that
    ``explicit`` (the command line) gives itself. Problems are ``parser.error`` (exit 2)."""
    data = _load_mapping(path, parser)
    options = _options_by_key(parser)
    given = {s for tok in explicit if tok.startswith("--") for s in (tok.split("=", 1)[0],)}
    out: list[str] = []
    for key, value in data.items():
        action = options.get(str(key).strip().lstrip("-").replace("-", "_"))
        if action is None:
            close = difflib.get_close_matches(str(key).replace("-", "_"), sorted(options), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            parser.error(f"config file {path}: unknown key {key!r}{hint}")
        if given & set(action.option_strings):
            continue
        out += _as_argv(action, key, value, path, parser)
    return out


# ---- internal helpers -------------------------------------------------------------------------

def _flag(owner: type, f: dataclasses.Field, hint: Any, prefix: str) -> ConfigFlag:
    kind, optional = _strip_optional(hint)
    repeated = typing.get_origin(kind) is tuple
    if repeated:
        args = typing.get_args(kind)
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"{owner.__name__}.{f.name}: only tuple[X, ...] fields can be flags, got {hint}")
        kind = args[0]
    choices: tuple = ()
    if typing.get_origin(kind) is typing.Literal:
        choices = typing.get_args(kind)
        kind = type(choices[0])
    if kind not in (int, float, str, bool):
        raise TypeError(f"{owner.__name__}.{f.name}: no flag type for {hint}")
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    return ConfigFlag(owner=owner, name=f.name, flat=prefix + f.name, kind=kind, optional=optional, repeated=repeated, default=default,
                      doc=field_docs(owner).get(f.name, ""), choices=choices)


def _strip_optional(hint: Any) -> tuple[Any, bool]:
    """(the type without ``None``, whether ``None`` was allowed); a union with ``str`` is ``str``
    (e.g. ``dtype: str | torch.dtype``: the command line spells it)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        if len(args) == 1:
            return args[0], optional
        if str in args:
            return str, optional
        raise TypeError(f"no flag type for {hint}")
    return hint, False


def _fields_with_hints(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its attribute docstring (the string literal right under the field)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


@functools.cache
def _default_of(cls: type) -> Any:
    return cls()


def _show(flag: ConfigFlag) -> str:
    value = flag.default
    if flag.name.endswith("_bytes") and isinstance(value, int) and value >= 1 << 20:
        unit = max(u for u in range(1, 5) if value >= 1 << (10 * u))
        return f"{value / (1 << (10 * unit)):g}{'KMGT'[unit - 1]}iB"
    if isinstance(value, tuple):
        return " ".join(map(str, value)) or "none"
    return "none" if value is None else str(value)


def _metavar(flag: ConfigFlag) -> str:
    if flag.name.endswith("_bytes"):
        return "BYTES"
    return {int: "N", float: "X"}.get(flag.kind, flag.name.rsplit("_", 1)[-1].upper())


def _load_mapping(path: str, parser: argparse.ArgumentParser) -> dict:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        parser.error(f"config file {path}: {exc.strerror or exc}")
    try:
        if path.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # json.JSONDecodeError, yaml.YAMLError: both say where
        parser.error(f"config file {path} is not valid {'JSON' if path.endswith('.json') else 'YAML'}: {exc}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        parser.error(f"config file {path} must hold a mapping of option names to values, "
                     f"got {type(data).__name__}")
    return data


def _options_by_key(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every long option of ``parser`` (aliases included, ``--no-x`` and ``--config`` not) by its
    name with ``_`` for ``-``."""
    out: dict[str, argparse.Action] = {}
    for action in parser._actions:  # argparse has no public list of a parser's actions
        negated = isinstance(action, argparse.BooleanOptionalAction)
        for s in action.option_strings:
            if s.startswith("--") and s != "--config" and not (negated and s.startswith("--no-")):
                out[s[2:].replace("-", "_")] = action
    out.pop("help", None)
    return out


def _as_argv(action: argparse.Action, key: Any, value: Any, path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The entry as command-line tokens. One value is written ``--opt=value``: argparse would take a
    separate token starting with ``-`` (``api_key: "-secret"``, ``prompt: "-terse"``) for an option."""
    opt = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        if not isinstance(value, bool):
            parser.error(f"config file {path}: {key!r} must be true or false, got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [opt if value else "--no-" + opt[2:]]
        return [opt] if value else []
    if action.nargs == "?" and isinstance(value, bool):  # --ray [ADDRESS]: true is the bare flag,
        return [opt + "="] if value else []              # spelled "--ray=": no positional can follow as its value
    if isinstance(value, list):
        if isinstance(action, argparse._AppendAction):
            return [f"{opt}={_text(v)}" for v in value]
        if action.nargs in ("+", "*") and value:  # --served-model-name a b
            # separate tokens (no "--opt=" for several values): one starting with "-" would be read as
            # an option, as on the command line, and argparse's message would not name the file
            dashed = next((v for v in value if _text(v).startswith("-")), None)
            if dashed is not None:
                parser.error(f"config file {path}: {key!r} values cannot start with '-', got {dashed!r}")
            return [opt, *map(_text, value)]
        parser.error(f"config file {path}: {key!r} takes one value, got a list")
    if isinstance(value, dict):  # as JSON text, judged by the flag's own type (override_generation_config takes one)
        return [f"{opt}={json.dumps(value)}"]
    return [f"{opt}={_text(value)}"]


def _text(value: Any) -> str:
    return "none" if value is None else str(value)
