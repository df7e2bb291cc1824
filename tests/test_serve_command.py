"""dsa_image.runtime.serve_command: the one reader of a `vllm serve` command line and its --config file.

The config reader is held against PyYAML (the dev lock's; vLLM reads the file with
yaml.safe_load): on a file it reads it finds the keys and one-line values PyYAML finds, as vLLM
turns them into flags; a file it does not read for certain it refuses, never guesses."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsa_image.runtime import serve_command
from dsa_image.runtime.serve_command import ConfigError

yaml = pytest.importorskip("yaml", reason="PyYAML is in the dev lock (recipes/locks/dev.txt)")

READ = [
    "port: 9001\n",
    "# comment\n---\nport: 9001  # trailing comment\nhost: '::'\n",
    'max_model_len: 1024\n"served-model-name": mine\n\'api-key\': "k"\n',
    "compilation-config:\n  pass_config:\n    fuse_allreduce_rms: true\nport: 8001\n",
    "served-model-name:\n  - a\n  - b\nenforce-eager: true\ntensor-parallel-size: 4\n",
    "uds: /tmp/v.sock\nssl-certfile: /certs/c.pem\ngpu-memory-utilization: 0.9\n",
    "speculative-config: {method: mtp, num_speculative_tokens: 2}\nport: 1\n",
    "\ufeffport: 9001\n",  # a byte-order mark, as some editors write
]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "serve.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("text", READ)
def test_the_reader_finds_what_pyyaml_finds(tmp_path, text):
    path = _write(tmp_path, text)
    loaded = yaml.safe_load(path.read_text(encoding="utf-8-sig"))
    flags = serve_command.read_config(path)
    assert set(flags) == {serve_command.flag_name(f"--{key}") for key in loaded}
    for key, value in loaded.items():
        mine = flags[serve_command.flag_name(f"--{key}")]
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            assert mine == str(value), key  # vLLM passes str(value) on as the flag's value
        elif not isinstance(value, bool):
            assert mine is None, key  # set, but to no one-line value


@pytest.mark.parametrize("text", [
    "{port: 9001}\n",  # a flow mapping: which keys, this reader does not say
    "base: &b {port: 1}\n<<: *b\n",  # a merge key
    "port: 1\n---\nport: 2\n",  # a second document
    "? port\n: 9001\n",  # a complex key
])
def test_what_it_cannot_read_for_certain_it_refuses(tmp_path, text):
    path = _write(tmp_path, text)
    try:
        yaml.safe_load_all(path.read_text()).__next__()
    except yaml.YAMLError:
        pytest.fail("the document is valid YAML: the point is that this reader still refuses it")
    with pytest.raises(ConfigError, match="not a top-level `key: value` line"):
        serve_command.read_config(path)


def test_the_command_line_ranks_over_the_file_and_a_bare_double_dash_ends_the_flags(tmp_path):
    path = _write(tmp_path, "port: 9001\nhost: 10.0.0.5\n")
    serve = serve_command.parse(["m", "--config", str(path), "--port=9002", "--", "--host", "x"])
    assert (serve.value("--port"), serve.value("--host"), serve.value("--uds")) == ("9002", "10.0.0.5", None)
    assert serve.sets("--port") and serve.sets("--host") and not serve.sets("--max-model-len")
    assert serve_command.endpoint_of(serve).base_url == "http://10.0.0.5:9002"


def test_a_key_the_file_sets_to_no_plain_value_is_an_error_when_asked_for(tmp_path):
    serve = serve_command.parse(["m", "--config", str(_write(tmp_path, "port:\n  - 1\n")), "--host", "h"])
    assert serve.sets("--port") and serve.value("--host") == "h"
    with pytest.raises(ConfigError, match="sets port, but not to one plain value; pass --port on the command line"):
        serve.value("--port")


def test_a_relative_config_path_is_the_servers_working_directorys(tmp_path):
    _write(tmp_path, "port: 9001\n")
    assert serve_command.parse(["m", "--config", "serve.yaml"], cwd=tmp_path).value("--port") == "9001"
