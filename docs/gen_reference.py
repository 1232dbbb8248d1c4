"""Write the generated reference pages (run by the mkdocs-gen-files plugin at every build).

- `reference/cli.md`: every `relayrl` subcommand's flags, from the argparse parsers themselves.
- `reference/config.md`: every config key with its type, default and meaning. The meaning is the
  field's documentation in the source: an attribute docstring under the field if it has one,
  else the `#` comment on the field's line, else the comment lines just above it. A comment line
  between two fields belongs to the next field when that field has no comment of its own on its
  line, and otherwise continues the previous field's.
- `reference/http-api.md` and `reference/openapi.json`: the gateway's routes, from the OpenAPI
  document the gateway serves at `/openapi.json`.

Nothing here starts a server or loads a model: the gateway app is built without dependencies
(routes need them only to answer requests) and asked for its OpenAPI document.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import enum
import html
import inspect
import io
import json
import textwrap
import tokenize
import typing
from collections.abc import Callable, Iterator
from typing import Any

# -- config ------------------------------------------------------------------------------------


def field_docs(cls: type) -> dict[str, str]:
    """Each field's documentation, read from the class's source (see the module docstring)."""
    source = textwrap.dedent(inspect.getsource(cls))
    tree = ast.parse(source)
    body = tree.body[0].body  # type: ignore[attr-defined]
    comments = _comments_by_line(source)
    code_lines = {n.lineno for n in ast.walk(tree) if hasattr(n, "lineno")}
    fields = [(i, n) for i, n in enumerate(body)
              if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    docs: dict[str, str] = {}
    pending: list[str] = []  # comment-only lines since the previous field
    previous: str | None = None
    line = body[0].lineno if body else 1
    for index, node in fields:
        name = node.target.id  # type: ignore[union-attr]
        between = [comments[n] for n in range(line, node.lineno)
                   if n in comments and n not in code_lines]
        trailing = " ".join(comments[n] for n in range(node.lineno, node.end_lineno + 1)
                            if n in comments)
        pending = between
        if trailing and pending and previous is not None:
            docs[previous] = " ".join([docs.get(previous, ""), *pending]).strip()
            pending = []
        text = trailing or " ".join(pending)
        after = body[index + 1] if index + 1 < len(body) else None
        if (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            text = inspect.cleandoc(after.value.value)
        docs[name] = text
        previous = name
        line = (after.end_lineno + 1) if isinstance(after, ast.Expr) else node.end_lineno + 1
    return docs


def _comments_by_line(source: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if text and not set(text) <= {"-", "="}:
                out[tok.start[0]] = text
    return out


def _annotation(cls: type, name: str) -> str:
    source = textwrap.dedent(inspect.getsource(cls))
    for node in ast.parse(source).body[0].body:  # type: ignore[attr-defined]
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name:
            return ast.get_source_segment(source, node.annotation) or ""
    return ""


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value) if value is None or isinstance(value, (bool, list, dict, str)) \
        else repr(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    """Inline code for a table cell (a `|` inside backticks would show its escape)."""
    return "<code>" + html.escape(text).replace("|", "&#124;").replace("\n", " ") + "</code>"


def config_rows(cls: type, prefix: str = "") -> Iterator[tuple[str, type, list[str]]]:
    """(section, class, table rows) for `cls` and every dataclass nested in it, depth first."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        if not f.init or f.name.startswith("_"):
            continue
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            nested.append((key, hints[f.name]))
            meaning = docs.get(f.name) or _summary(hints[f.name]).split("\n")[0]
            rows.append(f"| `{key}` | section | | {_cell(meaning)} "
                        f"([below](#{key.replace('.', '')})) |")
            continue
        rows.append(f"| `{key}` | {_code(_annotation(cls, f.name))} | {_code(_default(f))} "
                    f"| {_cell(docs.get(f.name, ''))} |")
    yield prefix.rstrip("."), cls, rows
    for key, sub in nested:
        yield from config_rows(sub, key + ".")


def undocumented(cls: type, prefix: str = "") -> list[str]:
    """Dotted keys of `cls` (nested sections included) whose field has no documentation."""
    missing: list[str] = []
    for section, sub, _rows in config_rows(cls, prefix):
        docs = field_docs(sub)
        hints = typing.get_type_hints(sub)
        for f in dataclasses.fields(sub):
            if dataclasses.is_dataclass(hints[f.name]):
                continue  # a section: documented by its class's docstring
            if f.init and not f.name.startswith("_") and not docs.get(f.name):
                missing.append(f"{section + '.' if section else ''}{f.name}")
    return missing


def _config_page() -> str:
    from relayrl.config import RelayConfig
    from relayrl.remote_rollout.config import ServerConfig

    out = ["# Configuration keys", "",
           "Every key a run's YAML config takes (`relayrl train CONFIG`, `relayrl serve CONFIG`, "
           "`examples/math_agent/config.yaml`), with its type, its default and what it does. "
           "Any key can be overridden on the command line as `dotted.key=value` "
           "(`relayrl train cfg.yaml train.lr=1e-6 rollout.group_size=8`); an unknown key or a "
           "value of the wrong type stops the run with an error naming the key.", "",
           "This page is generated from the config dataclasses and the comments on their fields.",
           ""]
    tables = [("Run config (`RelayConfig`)", RelayConfig, "")]
    for title, cls, prefix in tables:
        out += [f"## {title}", ""]
        for section, sub, rows in config_rows(cls, prefix):
            if section:
                out += [f"### `{section}`", "", _summary(sub), ""]
            out += ["| key | type | default | meaning |", "| --- | --- | --- | --- |", *rows, ""]
    out += ["## Rollout server settings (`relayrl rollout-server`)", "",
            "The reference remote rollout server reads these from its flags "
            "([command line](cli.md#relayrl-rollout-server)) or the environment variables named "
            "below; see [Remote rollouts](../remote-rollout.md).", ""]
    for _section, sub, rows in config_rows(ServerConfig):
        out += [_summary(sub), "", "| key | type | default | meaning |", "| --- | --- | --- | --- |",
                *rows, ""]
    return "\n".join(out)


def _summary(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    return doc if not doc.startswith(cls.__name__ + "(") else ""


# -- CLI ---------------------------------------------------------------------------------------


def _help_text(main: Callable[[list[str]], Any], argv: list[str]) -> str:
    """What `main(argv + ['--help'])` prints (argparse exits after printing it)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        main([*argv, "--help"])
    return buf.getvalue()


def _options_table(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| argument | default | meaning |", "| --- | --- | --- |"]
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = ", ".join(action.option_strings) or action.dest
        if action.option_strings and action.nargs != 0:
            metavar = action.metavar or action.dest.upper()
            name += " " + (" ".join(metavar) if isinstance(metavar, tuple) else metavar)
        default = "" if action.default in (None, argparse.SUPPRESS) or action.nargs == 0 \
            else _code(str(action.default))
        if action.choices:
            name += " {" + ",".join(map(str, action.choices)) + "}"
        rows.append(f"| {_code(name)} | {default} | {_cell(action.help or '')} |")
    return rows


def _cli_page() -> str:
    from relayrl import cli
    from relayrl.remote_rollout import cli as rollout_cli
    from relayrl.router import cli as router_cli
    from relayrl.viewer import main as view_main

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub._choices_actions}
    own_parsers = {"rollout-server": rollout_cli.build_parser(), "router": router_cli.build_parser()}
    out = ["# Command line: `relayrl`", "",
           "Generated from the argparse parsers. `relayrl SUBCOMMAND --help` prints the same.", ""]
    for name, subparser in sub.choices.items():
        out += [f"## `relayrl {name}`", "", _cell(helps.get(name) or ""), ""]
        if name in own_parsers:
            out += _options_table(own_parsers[name])
        elif name == "view":
            out += ["```text", _help_text(view_main, []).rstrip(), "```"]
        else:
            out += _options_table(subparser)
        out.append("")
    return "\n".join(out)


# -- HTTP API ----------------------------------------------------------------------------------


def openapi_document() -> dict[str, Any]:
    """The gateway's OpenAPI document, as `GET /openapi.json` answers it."""
    from types import SimpleNamespace

    from relayrl.gateway.app import create_app
    from relayrl.gateway.config import GatewayConfig
    from relayrl.gateway.core import GatewayDeps
    from relayrl.gateway.session_store import SessionStore

    # A real session store; no model: the routes reach the renderer and engine per request only
    # (the viewer's mount keeps a reference to the renderer's decode).
    cfg = GatewayConfig()
    store = SessionStore(ttl_s=cfg.session_ttl_s, max_sessions=cfg.max_sessions, log=None,
                         ended_ttl_s=cfg.ended_ttl_s)
    renderer = SimpleNamespace(decode=lambda ids: "")
    deps = GatewayDeps(config=cfg, renderer=typing.cast(Any, renderer),
                       engine=typing.cast(Any, None), store=store)
    return create_app(deps).openapi()


def _http_page(doc: dict[str, Any]) -> str:
    out = ["# HTTP API of the gateway", "",
           "Every route the gateway serves, from the OpenAPI document it publishes at "
           "`GET /openapi.json` ([download it](openapi.json)). What the routes mean, the keys "
           "and the errors are in [the gateway protocol](../protocol.md).", "",
           "| method | path | summary | body |", "| --- | --- | --- | --- |"]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if method not in {"get", "post", "put", "delete", "patch"}:
                continue
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
            ref = body.get("schema", {}).get("$ref", "")
            schema = ref.rsplit("/", 1)[-1]
            link = f"[`{schema}`](#{schema.lower()})" if schema else ""
            summary = op.get("summary") or op.get("description", "").split("\n")[0]
            out.append(f"| `{method.upper()}` | `{path}` | {_cell(summary)} | {link} |")
    out += ["", "## Request bodies", ""]
    schemas = doc.get("components", {}).get("schemas", {})
    used = {op.get("requestBody", {}).get("content", {}).get("application/json", {})
            .get("schema", {}).get("$ref", "").rsplit("/", 1)[-1]
            for ops in doc["paths"].values() for op in ops.values() if isinstance(op, dict)}
    for name in sorted(n for n in used if n in schemas):
        schema = schemas[name]
        required = set(schema.get("required", []))
        out += [f"### {name}", "", _cell(schema.get("description", "")), "",
                "| field | type | required | description |", "| --- | --- | --- | --- |"]
        for field_name, prop in schema.get("properties", {}).items():
            out.append(f"| `{field_name}` | {_cell(_schema_type(prop))} | "
                       f"{'yes' if field_name in required else ''} | "
                       f"{_cell(prop.get('description', ''))} |")
        out.append("")
    return "\n".join(out)


def _schema_type(prop: dict[str, Any]) -> str:
    if "$ref" in prop:
        return prop["$ref"].rsplit("/", 1)[-1]
    for key in ("anyOf", "oneOf"):
        if key in prop:
            return " or ".join(_schema_type(p) for p in prop[key])
    if prop.get("type") == "array":
        return f"array of {_schema_type(prop.get('items', {}))}"
    if "const" in prop:
        return json.dumps(prop["const"])
    if "enum" in prop:
        return " | ".join(json.dumps(v) for v in prop["enum"])
    return str(prop.get("type", "any"))


def main() -> None:
    """Write the generated pages into the site being built."""
    import mkdocs_gen_files

    pages = {"reference/config.md": _config_page(), "reference/cli.md": _cli_page()}
    doc = openapi_document()
    pages["reference/http-api.md"] = _http_page(doc)
    pages["reference/openapi.json"] = json.dumps(doc, indent=2)
    for path, text in pages.items():
        with mkdocs_gen_files.open(path, "w") as f:
            f.write(text + "\n")
        if path.endswith(".md"):
            mkdocs_gen_files.set_edit_path(path, "gen_reference.py")


if __name__ in ("__main__", "<run_path>"):  # mkdocs-gen-files runs this file by path
    main()
