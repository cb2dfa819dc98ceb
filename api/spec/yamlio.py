"""The one way meshrun reads run specs: YAML with YAML-1.2 numbers, and one RunSpec parse for every entry point.

PyYAML implements YAML 1.1, where ``3e-4`` and ``1e3`` (no dot) are *strings*; YAML 1.2 and every JSON/Python
reader take them as floats. ``load_yaml`` adds the YAML-1.2 float forms to the safe loader, so a spec file, a
``--set optimizer.lr=1e-3`` override and a YAML request body all read ``3e-4`` as the number 0.0003.

``parse_run_spec(data)`` is the server's validation of a JSON body (strict: programs send proper types, ``true``
is not ``1`` and ``"3"`` is not 3). The SDK always sends JSON, so ``meshrun validate`` uses the same function
and accepts exactly what ``meshrun submit`` will get accepted.

Importing this module needs only PyYAML (pydantic and api.spec are imported when a spec is parsed).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from api.spec.run import RunSpec

__all__ = ["YAMLError", "YamlLimitError", "Yaml12SafeLoader", "check_yaml_limits", "load_yaml", "parse_run_spec"]

YAMLError = yaml.YAMLError

# Limits that hold before the document is built: libyaml's composer recurses in C without a bound (30,000 nested
# '[' overflow the C stack and kill the process), so the event stream (a flat, non-recursive scan) is checked first
MAX_YAML_BYTES = 4 * 1024 * 1024
MAX_YAML_DEPTH = 64
MAX_YAML_NODES = 20_000
MAX_MAPPING_KEYS = 1_000


class YamlLimitError(yaml.YAMLError, ValueError):
    """A YAML document over a size, depth, node-count or key-count limit (raised before it is built)."""


# YAML 1.2 core-schema floats that YAML 1.1 leaves as strings: an exponent without a dot ("3e-4", "1E+3", "-2e5")
# and a dot with an exponent but no fraction digits ("1.e3" is already a 1.1 float). Plain integers and the
# forms 1.1 already reads as floats ("0.1", ".5", "1.5e-3", ".inf", ".nan") are left to the existing resolvers.
_YAML12_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$")

_SafeBase: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C parser when libyaml is there (fast)


class Yaml12SafeLoader(_SafeBase):
    """PyYAML's safe loader (plain data only) that also reads YAML-1.2 exponent floats such as ``3e-4``."""


Yaml12SafeLoader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_EXPONENT_FLOAT, list("-+0123456789."))


def check_yaml_limits(
    text: str | bytes,
    *,
    max_bytes: int = MAX_YAML_BYTES,
    max_depth: int = MAX_YAML_DEPTH,
    max_nodes: int = MAX_YAML_NODES,
    max_keys: int = MAX_MAPPING_KEYS,
) -> None:
    """Raise ``YamlLimitError`` if the document is larger, deeper, has more nodes (scalars, collections, aliases)
    or a mapping with more keys than allowed. Reads only the event stream (no recursion, stops at the first
    excess), so it is safe on any input."""
    size = len(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
    if size > max_bytes:
        raise YamlLimitError(f"YAML document of {size} bytes is over the limit of {max_bytes} bytes")
    _check_flow_depth(text if isinstance(text, str) else text.decode("utf-8", "replace"), max_depth)
    children: list[list[Any]] = []  # per open collection: [is_mapping, child count]
    nodes = 0
    events = yaml.parse(text, Loader=_SafeBase)
    while True:
        try:
            event = next(events)
        except StopIteration:
            return
        except yaml.YAMLError as e:
            # PyYAML >= 6.0.4 refuses deep flow nesting in its scanner (before any event): that is this limit
            if "nesting depth" in str(e):
                raise YamlLimitError(f"YAML document is nested deeper than {max_depth} levels") from None
            raise
        if isinstance(event, yaml.CollectionEndEvent):
            children.pop()
            continue
        if not isinstance(event, yaml.NodeEvent):
            continue
        nodes += 1
        if nodes > max_nodes:
            raise YamlLimitError(f"YAML document has more than {max_nodes} values; send a smaller document")
        if children:
            top = children[-1]
            top[1] += 1
            if top[0] and top[1] > 2 * max_keys:
                raise YamlLimitError(f"a YAML mapping has more than {max_keys} keys; send a smaller document")
        if isinstance(event, yaml.CollectionStartEvent):
            children.append([isinstance(event, yaml.MappingStartEvent), 0])
            if len(children) > max_depth:
                raise YamlLimitError(f"YAML document is nested deeper than {max_depth} levels")


# the characters that open or close flow collections, quote, escape, comment or end a line
_FLOW_CHARS = re.compile(r"[\[\]{}'\"\\#\n]")


def _check_flow_depth(text: str, max_depth: int) -> None:
    """Refuse flow nesting ('[' / '{') deeper than ``max_depth`` with a scan of our own, before PyYAML sees the
    text: its scanner looks ahead across a whole run of '[' (each may start a simple key), so its own limit (a
    ScannerError since PyYAML 6.0.4) or, before that, libyaml's unbounded recursion would act first. The scan
    skips quoted scalars and comments; it may count brackets inside block scalars, which matters only for a
    document nested that deep anyway."""
    depth = 0
    quote = ""  # the open quote character, if any
    comment = False
    skip_until = 0  # a backslash in a double-quoted scalar escapes the next character
    for m in _FLOW_CHARS.finditer(text):
        ch, at = m.group(), m.start()
        if at < skip_until:
            continue
        if comment:
            comment = ch != "\n"
        elif quote:
            if ch == "\\" and quote == '"':
                skip_until = at + 2
            elif ch == quote:
                quote = ""
        elif ch in "[{":
            depth += 1
            if depth > max_depth:
                raise YamlLimitError(f"YAML document is nested deeper than {max_depth} levels")
        elif ch in "]}":
            depth = max(0, depth - 1)
        elif ch in "'\"" and (at == 0 or text[at - 1] in " \t\n[{,:-?"):
            quote = ch
        elif ch == "#" and (at == 0 or text[at - 1] in " \t\n"):
            comment = True


def load_yaml(text: str | bytes) -> Any:
    """Parse one YAML document into plain data (dict/list/str/int/float/bool/None/date), after checking its
    size, depth, node and key counts (``check_yaml_limits``). Raises ``yaml.YAMLError`` (also exported as
    ``api.spec.yamlio.YAMLError``) for malformed or oversized input."""
    check_yaml_limits(text)
    return yaml.load(text, Loader=Yaml12SafeLoader)


def parse_run_spec(data: Any) -> RunSpec:
    """A RunSpec from plain JSON-able data, validated as the server validates a JSON body (strict types).
    Raises ``pydantic.ValidationError`` naming the field (TypeError for data JSON cannot hold, e.g. a date)."""
    from api.spec.run import RunSpec

    return RunSpec.model_validate_json(json.dumps(data), strict=True)
