"""containers/entrypoint.sh, the ENTRYPOINT of every image, run here on the host (no GPU, no podman):
the serve image's `sglang ARGS` execs exactly the command `eaglenest serve ARGS --print-command`
prints for the same export; eaglenest commands and Prefect's worker command are dispatched as documented.

EAGLENEST_DRY_RUN=1 makes the entrypoint print the argv it would exec, one argument per line."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flows import cli
from tests.containers.conftest import CONTAINERS

ENTRYPOINT = CONTAINERS / "entrypoint.sh"


def host_env(**extra: str) -> dict[str, str]:
    """The venv's `eaglenest` first on PATH, as /usr/local/bin/eaglenest is in the images."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **extra}


def entrypoint_argv(*args: str) -> list[str]:
    """What the entrypoint would exec for `docker run IMAGE args...`."""
    result = subprocess.run(["sh", str(ENTRYPOINT), *args], capture_output=True, text=True, timeout=300,
                            env=host_env(EAGLENEST_DRY_RUN="1"))
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def printed_command(capsys, *serve_args: str) -> list[str]:
    """What `eaglenest serve ARGS --print-command` prints (in this process: the same code path, less a torch import)."""
    capsys.readouterr()
    assert cli.main(["serve", *serve_args, "--print-command"]) == 0
    return shlex.split(capsys.readouterr().out)


def test_serve_image_execs_exactly_the_printed_sglang_command(tiny_export, capsys):
    w = tiny_export
    args = ("--config", str(w["config"]), "--draft", str(w["draft_dir"]), "--target-path", str(w["target_dir"]),
            "--set", "serve.host=0.0.0.0")
    argv = entrypoint_argv("sglang", *args)
    assert argv == printed_command(capsys, *args)
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    assert argv[argv.index("--speculative-algorithm") + 1] == "EAGLE3"
    assert argv[argv.index("--speculative-draft-model-path") + 1] == str(w["draft_dir"])
    assert argv[argv.index("--host") + 1] == "0.0.0.0"


def test_serve_argv_survives_paths_with_spaces_and_quotes(tiny_export, tmp_path, capsys):
    """The printed line is shell-quoted; the entrypoint must split it back into the same arguments."""
    draft = tmp_path / "a draft 'quoted' $HOME"
    shutil.copytree(tiny_export["draft_dir"], draft)
    args = ("--config", str(tiny_export["config"]), "--draft", str(draft), "--target-path",
            str(tiny_export["target_dir"]))
    argv = entrypoint_argv("sglang", *args)
    assert argv == printed_command(capsys, *args)
    assert argv[argv.index("--speculative-draft-model-path") + 1] == str(draft)


def test_serve_image_refuses_a_draft_that_fails_preflight(tiny_export, tmp_path):
    """F1/F7 preflight runs before anything is exec'd: a wrong architecture exits 1 with the finding."""
    draft = tmp_path / "bad"
    shutil.copytree(tiny_export["draft_dir"], draft)
    config = (draft / "config.json").read_text().replace("LlamaForCausalLMEagle3", "LlamaForCausalLMEagle")
    (draft / "config.json").write_text(config)
    result = subprocess.run(["sh", str(ENTRYPOINT), "sglang", "--config", str(tiny_export["config"]), "--draft",
                             str(draft), "--target-path", str(tiny_export["target_dir"])],
                            capture_output=True, text=True, timeout=300, env=host_env(EAGLENEST_DRY_RUN="1"))
    assert result.returncode == 1 and result.stdout == ""
    assert "LlamaForCausalLMEagle" in result.stderr


@pytest.mark.parametrize(("args", "expected"), [
    (("mapping", "--config", "configs/tiny.yaml"), ["eaglenest", "mapping", "--config", "configs/tiny.yaml"]),
    (("serve", "--draft", "d"), ["eaglenest", "serve", "--draft", "d"]),
    (("prefect", "flow-run", "execute"), ["prefect", "flow-run", "execute"]),   # Prefect workers' command
    (("python", "-m", "steps.lib.reference.server", "--port", "1"),
     ["python", "-m", "steps.lib.reference.server", "--port", "1"]),
    ((), ["eaglenest", "--help"]),
])
def test_entrypoint_dispatches_eaglenest_commands_and_passes_others_through(args, expected):
    assert entrypoint_argv(*args) == expected


def test_the_entrypoint_knows_every_eaglenest_command():
    """The entrypoint asks `eaglenest --commands` (the registry): every command reaches eaglenest, no list to
    keep in step."""
    for command in cli.COMMANDS:
        assert entrypoint_argv(command, "--help")[:2] == ["eaglenest", command]
