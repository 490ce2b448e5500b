"""`--config FILE` for a command line: a YAML or TOML mapping whose keys are the command's
own option names (`max_loras`, `max-loras` and `tensor-parallel-size` all work). Values
go through each option's own parser, so a bad one gets the same one-line error as on the
command line; flags given on the command line override the file."""
from __future__ import annotations

import argparse
from pathlib import Path


class ConfigFileError(ValueError):
    """One line: the file, the key, what is wrong."""


def load_mapping(path: str) -> dict:
    """The top-level mapping of a .toml, .yaml/.yml or .json file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise ConfigFileError(f"--config {path}: {err.strerror or err}") from None
    try:
        if p.suffix == ".toml":
            data = _toml().loads(text)
        else:
            import yaml
            data = yaml.safe_load(text)
    except Exception as err:  # noqa: BLE001 - any parse error becomes one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigFileError(f"--config {path}: not valid {'TOML' if p.suffix == '.toml' else 'YAML'}: "
                              f"{first}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config {path}: the top level must be a mapping of option "
                              f"names to values, not {type(data).__name__}")
    return data


def _toml():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib


def _actions_by_name(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    names = {}
    for action in parser._actions:  # noqa: SLF001 - argparse has no public walk
        if not action.option_strings or action.dest in ("help", "config"):
            continue
        names[action.dest] = action
        for opt in action.option_strings:
            if opt.startswith("--") and not opt.startswith("--no-"):
                names[opt[2:].replace("-", "_")] = action
    return names


def defaults_from_file(parser: argparse.ArgumentParser, path: str) -> dict:
    """{dest: parsed value} for the keys of the config file at `path`; raises
    ConfigFileError naming the key that is unknown or whose value does not parse."""
    actions = _actions_by_name(parser)
    out = {}
    for key, value in load_mapping(path).items():
        action = actions.get(str(key).replace("-", "_"))
        if action is None:
            raise ConfigFileError(f"--config {path}: unknown option {key!r} "
                                  f"(see {parser.prog} --help)")
        try:
            out[action.dest] = _value(action, value)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as err:
            raise ConfigFileError(f"--config {path}: {key}: {err}") from None
    return out


def _value(action: argparse.Action, value):
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        if not isinstance(value, bool):
            raise ValueError(f"{value!r} must be true or false")
        return value
    if isinstance(action, argparse._AppendAction):  # noqa: SLF001
        items = value if isinstance(value, list) else [value]
        return [_one(action, v) for v in items]
    if isinstance(value, (list, dict)):
        raise ValueError(f"{value!r} must be a single value")
    return _one(action, value)


def _one(action: argparse.Action, value):
    if isinstance(value, bool):  # YAML/TOML booleans for on/off options
        value = "on" if value else "off"
    text = str(value)
    parsed = action.type(text) if action.type else text
    if action.choices is not None and parsed not in action.choices:
        raise ValueError(f"{text!r} is not one of {', '.join(map(str, action.choices))}")
    return parsed
