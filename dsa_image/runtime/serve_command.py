"""What a `vllm serve` command line says: its flags, the `--config` file it names, where it listens.

The one reader of vLLM's arguments in this image. The entrypoint asks it which flags a user
already set (its defaults must not override them), the warm-up and the healthcheck where the
server listens; with one reader they cannot read one command line two ways.

Flags as vLLM's parser takes them: `--name value` or `--name=value`, `_` for `-`, the last one
wins; nothing after a bare `--` is a flag. A flag at the very end without its value (vLLM refuses
that) is passed over. `--config FILE` is vLLM's YAML file whose top-level keys are flag names
without the dashes: it ranks below the command line and above vLLM's defaults, as in vLLM
(FlexibleArgumentParser._pull_args_from_config). Its path is relative to the server's working
directory.

The YAML is read without a YAML library (stdlib only): top-level `key: value` lines, and the
indented lines under a key (a nested table or a block value, which is then "set, not a plain
value"). Whatever else sits at the top level (a flow mapping, an anchor or merge key, a second
document) is a ConfigError naming the line: this reader never guesses which keys a file sets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from dsa_image.core import status
from dsa_image.core.endpoint import VLLM_DEFAULT_PORT, Endpoint

CONFIG_FLAG = "--config"
# A wildcard address listens on loopback too.
_WILDCARDS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


class ConfigError(status.DsaImageError, ValueError):
    """The --config file cannot be read, or not with certainty."""

    exit_code = status.USAGE


def flag_name(arg: str) -> str:
    """`--max_model_len=4096` -> `--max-model-len`."""
    return arg.split("=", 1)[0].replace("_", "-")


def options(args: list[str]) -> list[str]:
    """The words before a bare `--` (after it every word is positional)."""
    return args[:args.index("--")] if "--" in args else list(args)


def cli_value(args: list[str], name: str) -> str | None:
    """The value the command line gives --name, or None."""
    words, value = options(args), None
    for i, arg in enumerate(words):
        if not arg.startswith("--") or flag_name(arg) != name:
            continue
        if "=" in arg:
            value = arg.split("=", 1)[1]
        elif i + 1 < len(words):
            value = words[i + 1]
    return value


# -- the --config file ---------------------------------------------------------------------------

_TOP_LEVEL = re.compile(r"""(?:"(?P<dq>[^"\\]+)"|'(?P<sq>[^']+)'|(?P<plain>[A-Za-z0-9][A-Za-z0-9_.-]*))"""
                        r"""[ ]*:(?:[ ]+(?P<value>.*))?""")
_NOT_PLAIN = tuple("[{|>&*!%@`")


def _scalar(text: str | None) -> str | None:
    """A one-line YAML value as text; None when it is not a plain or quoted scalar."""
    text = re.sub(r"\s+#.*$", "", text or "").strip()
    if not text or text in ("~", "null", "Null", "NULL") or text.startswith(_NOT_PLAIN):
        return None
    if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":
        inner = text[1:-1]
        return None if "\\" in inner or text[0] in inner else inner
    return None if text.startswith(("'", '"')) else text


def read_config(path: Path) -> dict[str, str | None]:
    """The flags a vLLM --config file sets ('--max-model-len'), each with its value as text (None:
    set, but not to a one-line value). Raises ConfigError."""
    try:
        text = Path(path).read_bytes().decode("utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc})") from None
    flags: dict[str, str | None] = {}
    last = None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"--config {path}, line {number} ({line.strip()[:60]!r})"
        if line.startswith("\t"):
            raise ConfigError(f"{where}: a tab indents it (YAML does not allow that)")
        if line.startswith(" "):  # under the previous key: its value is a table or a block
            if last is None:
                raise ConfigError(f"{where}: indented before any key")
            flags[last] = None
            continue
        if line.rstrip() == "---" and not flags:
            continue
        match = _TOP_LEVEL.fullmatch(line.rstrip())
        if not match:
            raise ConfigError(f"{where}: not a top-level `key: value` line; write the file as flat `flag-name: "
                              "value` lines (nested tables indented under their key), or pass the flag on the "
                              "command line")
        key = match["dq"] or match["sq"] or match["plain"]
        last = flag_name(f"--{key}")
        flags[last] = _scalar(match["value"])
    return flags


@dataclass(frozen=True)
class ServeArgs:
    """A `vllm serve` command line (the arguments after `serve`) and its --config file's flags."""

    args: list[str]
    config: dict[str, str | None] = field(default_factory=dict)

    def sets(self, name: str) -> bool:
        """Whether the command line or the config file gives --name (vLLM's default then does not apply)."""
        return any(flag_name(a) == name for a in options(self.args) if a.startswith("--")) or name in self.config

    def value(self, name: str) -> str | None:
        """The command line's value for --name, else the config file's; None when neither sets it.
        Raises ConfigError when only the file sets it, to no one-line value."""
        given = cli_value(self.args, name)
        if given is not None or name not in self.config:
            return given
        if self.config[name] is None:
            raise ConfigError(f"the --config file sets {name[2:]}, but not to one plain value; pass {name} on the "
                              "command line")
        return self.config[name]


def parse(args: list[str], cwd: Path | None = None) -> ServeArgs:
    """`args` with the flags of the --config file they name (relative paths from `cwd`, default
    this process's directory). Raises ConfigError."""
    path = cli_value(args, CONFIG_FLAG)
    if path is None:
        return ServeArgs(list(args))
    return ServeArgs(list(args), read_config(Path(cwd or ".") / path))


# -- where it listens ----------------------------------------------------------------------------


def endpoint_of(serve: ServeArgs, environ: Mapping[str, str] | None = None) -> Endpoint:
    """Where `vllm serve` with these arguments listens (vLLM's defaults: all addresses, port 8000).
    Raises ValueError for a port or host it cannot listen on."""
    api_key = serve.value("--api-key") or (environ or {}).get("VLLM_API_KEY") or None
    uds = serve.value("--uds")
    if uds:
        return Endpoint(uds=uds, api_key=api_key)
    host = serve.value("--host") or ""
    host = _WILDCARDS.get(host, host)
    if not re.fullmatch(r"[A-Za-z0-9._:%-]+", host):
        raise ValueError(f"--host {host!r}: not a host name or address")
    port_text = serve.value("--port")
    port = VLLM_DEFAULT_PORT if port_text is None else int(port_text) if port_text.isdigit() else -1
    if not 1 <= port <= 65535:
        raise ValueError(f"--port {port_text!r}: not a port number (1-65535)")
    scheme = "https" if serve.value("--ssl-certfile") else "http"
    return Endpoint(scheme, host, port, None, api_key)
