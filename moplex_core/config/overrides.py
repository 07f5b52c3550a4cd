"""``key=value`` text applied to a config (``moplex run --set``, ``prefect.yaml`` parameters), and a
pydantic error as one line per setting, naming the key that was probably meant."""

from __future__ import annotations

import difflib
import json
import logging
from collections.abc import Sequence
from types import UnionType
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

C = TypeVar("C", bound=BaseModel)

log = logging.getLogger(__name__)


def with_overrides(config: C, assignments: Sequence[str]) -> C:
    """A copy of ``config`` with ``key=value`` assignments applied (dotted keys reach nested blocks).

    Values are read as JSON when they parse (``3``, ``0.5``, ``true``, ``null``, ``[0.8, 0.1, 0.1]``)
    and as plain strings otherwise; a setting that takes text keeps a number or boolean as typed (a
    root or revision named ``2024``). Unknown keys and invalid values raise one ``ValueError`` naming
    every one of them.
    """
    data = config.model_dump(mode="json")
    known = _dotted_keys(data)
    blocks = [key for key in known if isinstance(_at(data, key), dict)]  # before any assignment changes data
    problems = []
    replaced: dict[str, tuple[dict[str, Any], set[str]]] = {}  # a block given whole: its settings before, those given
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        try:
            assignment.encode("utf-8")
        except UnicodeEncodeError:  # bytes of another encoding, as Python hands them on (surrogateescape)
            problems.append(f"  {key.encode('utf-8', 'replace').decode()}: holds bytes that are not UTF-8 text (a "
                            "terminal in another encoding?); a setting is hashed into its version as UTF-8")
            continue
        if not sep or not key:
            example = assignment if assignment in known else _example_key(data)
            problems.append(f"  {assignment!r}: expected key=value (e.g. {example}=...)")
            continue
        value = _as_value(raw)
        node = data
        *parents, leaf = key.split(".")
        for depth, part in enumerate(parents):
            if not isinstance(node.get(part), dict):
                block = ".".join(parents[:depth + 1])
                left_out = part in node and node[part] is None  # augment=null: a block this config leaves out
                if left_out and _blocks_in(_annotation_at(type(config), parents[:depth + 1])):
                    problems.append(f"  {key}: {block} is null here, so it has no {leaf!r} to set; give the whole "
                                    f"block first ({block}={{...}} with every setting it needs)")
                    break
                unprefixed = key.split(".", 1)[1]  # `ingest.validation` given to the ingest config itself
                own_name = depth == 0 and part not in data and unprefixed in known
                meant = unprefixed if own_name else _closest_key(block, blocks)
                within = ".".join(parents[:depth]) or type(config).__name__
                problems.append(f"  {key}: {part!r} is not a block of {within}"
                                + (f"; did you mean {meant}?" if meant else ""))
                break
            node = node[part]
        else:
            annotation = _annotation_at(type(config), [*parents, leaf])
            if isinstance(value, (bool, int, float)) and str in _types_in(annotation):
                value = raw  # a setting that takes text keeps what was typed
            elif boolean := _boolean_for_a_number(value, annotation, key):  # pydantic would read true as 1
                where, expected = boolean
                problems.append(f"  {where}: expected {expected}, not a boolean (got {raw})")
                continue
            for block, (_, given) in replaced.items():  # typed after the block: the user's, not a reset
                if key.startswith(f"{block}."):
                    given.add(key[len(block) + 1:].split(".")[0])
            if isinstance(value, dict) and isinstance(node.get(leaf), dict):
                replaced[key] = (node[leaf], set(value))
            node[leaf] = value
    try:
        validated = type(config).model_validate(data)
    except ValidationError as err:
        problems.append(describe_validation_error(err, known, type(config)))
    if problems:
        given = f" (overrides {list(assignments)})" if assignments else ""
        raise ValueError(f"invalid {type(config).__name__} settings{given}:\n" + "\n".join(problems))
    _say_what_whole_blocks_reset(replaced, validated.model_dump(mode="json"))
    return validated


def _say_what_whole_blocks_reset(replaced: dict[str, tuple[dict[str, Any], set[str]]], now: dict[str, Any]) -> None:
    """A block given whole (``train={"k": 2}``) takes its other settings' defaults: say which of them
    that changed, since ``train.k=2`` was more likely meant. ``replaced``: each such block's settings
    before it, and those the user gave (in it, or typed on their own after it)."""
    for key, (before, given) in replaced.items():
        after = _at(now, key)
        reset = [f"{name} {json.dumps(before[name])} -> {json.dumps(after.get(name))}" for name in before
                 if name not in given and before[name] != after.get(name)]
        if reset:
            log.warning("%s={...} replaces the whole block, so its other settings are back at their defaults: %s "
                        "(to change one setting, give %s.NAME=VALUE)", key, ", ".join(reset), key)


def as_assignments(config: BaseModel, keys: Sequence[str]) -> list[str]:
    """``key=value`` for each of the dotted ``keys`` (once each), that `with_overrides` reads back as
    ``config``'s values wherever it is applied again: a path as the config holds it (made absolute),
    text quoted only where it would read as JSON (``"2024"``, ``"null"``)."""
    data = config.model_dump(mode="json")
    keys = list(dict.fromkeys(keys))
    whole = [key for key in keys if not any(key.startswith(f"{block}.") for block in keys)]  # a block carries its keys
    return [f"{key}={_as_text(_at(data, key))}" for key in whole]


def _as_value(text: str) -> Any:
    """``text`` as the JSON it reads as (``0.6``), else as text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        try:
            json.loads(value)
        except json.JSONDecodeError:
            return value
    return json.dumps(value)


def _annotation_at(model: type[BaseModel], path: Sequence[str]) -> Any:
    """The type of the setting at dotted ``path`` of ``model`` (``str | None``, a `Device`, ...); None
    where there is no such setting (the validation then names the unknown key)."""
    annotation: Any = model
    for part in path:
        blocks = _blocks_in(annotation)
        field = blocks[0].model_fields.get(part) if blocks else None
        if field is None:
            return None
        annotation = field.annotation
    return annotation


def _type_names(types: Sequence[Any]) -> str:
    """The plain types among ``types`` as a user reads them: ``an integer or null``."""
    names = {int: "an integer", float: "a number", type(None): "null"}
    said = list(dict.fromkeys(names[t] for t in types if t in names))
    return " or ".join(said)


def _alternatives(annotation: Any) -> list[Any]:
    """The types ``annotation`` allows as a whole (the members of a union, Optional, Annotated), not
    those inside a list or tuple of it."""
    if get_origin(annotation) in (Union, UnionType):
        return [t for arg in get_args(annotation) for t in _alternatives(arg)]
    if get_origin(annotation) is Annotated:
        return _alternatives(get_args(annotation)[0])
    return [annotation]


def _boolean_for_a_number(value: Any, annotation: Any, key: str) -> tuple[str, str] | None:
    """The first place in ``value`` (as typed: JSON, a block's dict and a list's items included) that
    holds a boolean where a setting of type ``annotation`` takes a number and not a boolean, as (its
    dotted key, what it takes), or None."""
    alternatives = _alternatives(annotation)
    if isinstance(value, bool):
        numbers = int in alternatives or float in alternatives
        return (key, _type_names(alternatives)) if numbers and bool not in alternatives else None
    if isinstance(value, list):
        lists = [get_args(t) for t in alternatives if get_origin(t) in (tuple, list)]
        for i, item in enumerate(value):
            for args in lists:
                item_type = args[0] if len(args) == 1 or args[-1] is Ellipsis else args[i] if i < len(args) else None
                if found := _boolean_for_a_number(item, item_type, f"{key}.{i}"):
                    return found
    if isinstance(value, dict):
        for block in _blocks_in(annotation):
            for name, item in value.items():
                field = block.model_fields.get(name)
                if field is not None and (found := _boolean_for_a_number(item, field.annotation, f"{key}.{name}")):
                    return found
    return None


def _blocks_in(annotation: Any) -> list[type[BaseModel]]:
    """The blocks of settings (models) a setting of type ``annotation`` can hold."""
    return [t for t in _types_in(annotation) if isinstance(t, type) and issubclass(t, BaseModel)]


def _types_in(annotation: Any) -> list[Any]:
    """``annotation`` and every type inside it (unions, Optional, Annotated), flattened."""
    return [annotation, *(t for arg in get_args(annotation) for t in _types_in(arg))]


def _example_key(data: dict[str, Any]) -> str:
    """A real key of these settings to show in an error: the first one inside a block, else the first."""
    for name, value in data.items():
        if isinstance(value, dict) and value:
            return f"{name}.{next(iter(value))}"
    return next(iter(data), "key")


def _dotted_keys(data: dict[str, Any], prefix: str = "") -> list[str]:
    """Every setting of a dumped config as a dotted key (``train.em_iterations``), blocks included."""
    keys = []
    for name, value in data.items():
        keys.append(prefix + name)
        if isinstance(value, dict):
            keys += _dotted_keys(value, f"{prefix}{name}.")
    return keys


def _at(data: dict[str, Any], key: str) -> Any:
    """The value at dotted ``key`` of a dumped config."""
    for part in key.split("."):
        data = data[part]
    return data


def _closest_key(key: str, known: Sequence[str]) -> str | None:
    """The setting(s) ``key`` was probably meant as: a near spelling in its own block
    (``cache.score_batch_size`` for ``cache.batch_size``) and every setting of that name in other
    blocks (``train.em_iterations`` for ``em_iterations``), else the nearest spelling anywhere."""
    block, _, leaf = key.rpartition(".")
    siblings = [k for k in known if k.rpartition(".")[0] == block and k != key]
    close = difflib.get_close_matches(leaf, [k.rpartition(".")[2] for k in siblings], n=1, cutoff=0.75)
    same_name = [k for k in known if k.rpartition(".")[2] == leaf and k != key]
    if close or same_name:
        return " or ".join([*(f"{block}.{c}" if block else c for c in close), *same_name])
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    return close[0] if close else None


def describe_validation_error(err: ValidationError, known: Sequence[str] = (), model: type[BaseModel] | None = None
                              ) -> str:
    """One line per problem, ``dotted.key: what is wrong (got value)``, without pydantic's URLs;
    ``known`` (every dotted key of the settings) lets an unknown key name the one it was likely meant as;
    ``model`` (the settings' class) lets a list of text suggest its items as text."""
    lines = []
    needed: dict[str, int] = {}  # a list given with too few items: how many its missing ones say it needs
    for problem in err.errors():
        if problem["type"] == "missing" and problem["loc"] and isinstance(problem["loc"][-1], int):
            whole = ".".join(str(part) for part in problem["loc"][:-1])
            needed[whole] = max(needed.get(whole, 0), problem["loc"][-1] + 1)
    for problem in err.errors():
        key = ".".join(str(part) for part in problem["loc"])
        if problem["type"] == "missing" and problem["loc"] and isinstance(problem["loc"][-1], int):
            whole = ".".join(str(part) for part in problem["loc"][:-1])
            if whole in needed:
                given = problem.get("input")
                lines.append(f"  {whole}: expected {needed.pop(whole)} values, got "
                             f"{len(given) if isinstance(given, (list, tuple)) else 'fewer'} ({given!r})")
            continue
        if problem["type"] == "extra_forbidden":
            meant = _closest_key(key, known)
            hint = f"did you mean {meant}?" if meant else "check the spelling"
            lines.append(f"  {key}: unknown key (not a setting of this block; {hint})")
            continue
        message = problem["msg"].removeprefix("Value error, ")
        given = problem.get("input")
        said = isinstance(given, dict) or ", got " in message or (isinstance(given, str) and repr(given) in message)
        got = "" if said else f" (got {given!r})"
        if problem["type"] in ("tuple_type", "list_type") and isinstance(given, str):
            textual = model is not None and str in _types_in(_annotation_at(model, [str(p) for p in problem["loc"]]))
            items = [item.strip() if textual else _as_value(item.strip()) for item in given.split(",") if item.strip()]
            got += f"; a list is written as JSON: {key}='{json.dumps(items)}'"
        named = not key or message.startswith(f"{key}.")  # a block's validator that names its setting itself
        lines.append(f"  {'' if named else key + ': '}{message}{got}")
    return "\n".join(lines)
