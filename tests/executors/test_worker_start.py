"""How tensor- and pipeline-parallel worker processes start, seen from a user's script
run with ``python script.py``: a script without ``if __name__ == "__main__":`` works (the
workers do not run it), and where a start method that runs it again is chosen
(``PAGEDLLM_WORKER_MULTIPROC_METHOD=spawn``), the engine refuses at once, naming the line
and the fix, instead of dying of its workers' RuntimeError."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import clean_env
from repo_paths import ROOT
from tiny_models import load_reference, make_checkpoint, reference_greedy

from pagedllm.core.errors import ConfigError

NEW_TOKENS = 8

# Starts an engine at the script's top level: no `if __name__ == "__main__":`.
UNGUARDED = """\
import json, sys
from pagedllm import LLM, SamplingParams
prompts = json.loads(sys.argv[4])
llm = LLM(sys.argv[1], tensor_parallel_size=int(sys.argv[2]),
          pipeline_parallel_size=int(sys.argv[3]), dtype="float32", max_model_len=64)
params = SamplingParams(temperature=0.0, max_tokens={new}, min_tokens={new})
outputs = llm.generate([{{"prompt_token_ids": p}} for p in prompts], params, use_tqdm=False)
print("TOKENS " + json.dumps([o.outputs[0].token_ids for o in outputs]))
"""

# The same under the guard, with an hf_overrides function defined in the script (which
# a worker finds only by running the script: multiprocessing's spawn).
GUARDED = """\
import json, sys
from pagedllm import LLM, SamplingParams


def overrides(config):
    return config


def main():
    prompts = json.loads(sys.argv[4])
    llm = LLM(sys.argv[1], tensor_parallel_size=int(sys.argv[2]), hf_overrides=overrides,
              pipeline_parallel_size=int(sys.argv[3]), dtype="float32", max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens={new}, min_tokens={new})
    outputs = llm.generate([{{"prompt_token_ids": p}} for p in prompts], params, use_tqdm=False)
    print("TOKENS " + json.dumps([o.outputs[0].token_ids for o in outputs]))


if __name__ == "__main__":
    main()
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(6, 500, (n,), generator=g).tolist() for n in (4, 13)]
    reference = load_reference(directory)
    expected = [reference_greedy(reference, p, NEW_TOKENS)[0] for p in prompts]
    return directory, prompts, expected


def _run_script(
    tmp_path: Path, source: str, checkpoint, tp: int, pp: int, **env: str
) -> subprocess.CompletedProcess[str]:
    directory, prompts, _ = checkpoint
    script = tmp_path / "script.py"
    script.write_text(source.format(new=NEW_TOKENS))
    environment = clean_env(**env)
    environment.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
    environment.update(env)
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    return subprocess.run(
        [sys.executable, str(script), str(directory), str(tp), str(pp), json.dumps(prompts)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=environment,
        timeout=400,
    )


def _line_of(source: str, start: str) -> int:
    return next(n for n, text in enumerate(source.splitlines(), 1) if text.startswith(start))


def _tokens(result: subprocess.CompletedProcess[str]) -> list[list[int]]:
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("TOKENS ")]
    assert len(lines) == 1, result.stdout[-2000:]
    return json.loads(lines[0].removeprefix("TOKENS "))


@pytest.mark.parametrize(
    ("tp", "pp", "method"),
    [(2, 1, None), (1, 2, None), (2, 1, "fork")],
    ids=["tensor-parallel", "pipeline-parallel", "tensor-parallel-fork"],
)
def test_script_without_main_guard_runs_parallel(checkpoint, tmp_path, tp, pp, method):
    """``python script.py`` where the script builds ``LLM(..., tensor_parallel_size=2)``
    (or ``pipeline_parallel_size=2``) at its top level: greedy tokens are transformers'
    (one rank's), by default and with ``PAGEDLLM_WORKER_MULTIPROC_METHOD=fork``."""
    env = {"PAGEDLLM_WORKER_MULTIPROC_METHOD": method} if method else {}
    result = _run_script(tmp_path, UNGUARDED, checkpoint, tp, pp, **env)
    assert _tokens(result) == checkpoint[2]


@pytest.mark.parametrize(
    "variable", ["PAGEDLLM_WORKER_MULTIPROC_METHOD", "VLLM_WORKER_MULTIPROC_METHOD"]
)
def test_spawn_with_an_unguarded_script_is_refused_at_once(checkpoint, tmp_path, variable):
    """With spawn chosen, the unguarded script fails before any worker starts, with a
    message naming the variable, the script's line and the guard, not with a worker
    that exited (EngineDeadError) and Python's bootstrapping RuntimeError in its stderr."""
    result = _run_script(tmp_path, UNGUARDED, checkpoint, 2, 1, **{variable: "spawn"})
    assert result.returncode != 0
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("pagedllm.core.errors.ConfigError: "), result.stderr[-3000:]
    assert f"{variable}=spawn" in error
    line = _line_of(UNGUARDED, "llm = LLM(")
    assert f"{tmp_path / 'script.py'} again in each worker, and its line {line}," in error
    assert 'under `if __name__ == "__main__":`' in error
    assert "EngineDeadError" not in result.stderr
    assert "bootstrapping phase" not in result.stderr  # (no worker ran the script)


def test_script_objects_in_the_configuration(checkpoint, tmp_path):
    """An hf_overrides function defined in the script: the workers run the guarded script
    to find it (tokens as one rank's); the unguarded one is refused at once, naming it."""
    assert _tokens(_run_script(tmp_path, GUARDED, checkpoint, 2, 1)) == checkpoint[2]
    unguarded = GUARDED.replace('\n\nif __name__ == "__main__":\n    main()', "\nmain()")
    result = _run_script(tmp_path, unguarded, checkpoint, 1, 2)
    error = result.stderr.strip().splitlines()[-1]
    assert "refers to __main__.overrides, defined in the script" in error, result.stderr[-3000:]
    assert f"its line {_line_of(unguarded, 'main()')}," in error
    assert "define them in a module" in error


@pytest.mark.parametrize(
    ("source", "line", "guarded"),
    [
        ('if __name__ == "__main__":\n    x = 1\n', 2, True),
        ('if "__main__" == __name__:\n    x = 1\n', 2, True),
        ('x = 1\nif __name__ == "__main__":\n    y = 2\n', 1, False),
        ('if __name__ != "__main__":\n    x = 1\nelse:\n    y = 2\n', 4, True),
        ('if __name__ != "__main__":\n    x = 1\nelse:\n    y = 2\n', 2, False),
        ('try:\n    if __name__ == "__main__":\n        x = 1\nexcept E:\n    pass\n', 3, True),
        ('if __name__ == "__main__":\n    x = 1\nelse:\n    y = 2\n', 4, False),
        ("if DEBUG:\n    x = 1\n", 2, False),
    ],
)
def test_guard_detection(source, line, guarded):
    from pagedllm.executors.main_guard import _guarded

    assert _guarded(ast.parse(textwrap.dedent(source)), line) is guarded


def test_an_unknown_start_method_is_refused(monkeypatch):
    from pagedllm.executors.worker_start import chosen_method

    monkeypatch.setenv("PAGEDLLM_WORKER_MULTIPROC_METHOD", "forkserver")
    with pytest.raises(ConfigError, match="'forkserver': choose one of spawn, fork"):
        chosen_method()
    monkeypatch.delenv("PAGEDLLM_WORKER_MULTIPROC_METHOD")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "Spawn")
    assert chosen_method() == ("spawn", "VLLM_WORKER_MULTIPROC_METHOD")


def test_a_worker_that_exits_before_reading_is_reported_and_reaped(tmp_path, monkeypatch):
    """A rank's interpreter that exits at once (here: its sitecustomize): EngineDeadError
    naming the rank and the exit code, not a raw BrokenPipeError, and no process left."""
    from pagedllm.core.errors import EngineDeadError
    from pagedllm.executors.worker_start import RankStarter

    (tmp_path / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('PAGEDLLM_TEST_EXIT_AT_ONCE'):\n    os._exit(3)\n"
    )
    path = os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("PAGEDLLM_TEST_EXIT_AT_ONCE", "1")
    monkeypatch.delenv("PAGEDLLM_WORKER_MULTIPROC_METHOD", raising=False)
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    import subprocess

    started: list[int] = []
    real_popen = subprocess.Popen

    def recording_popen(*args, **kwargs):
        popen = real_popen(*args, **kwargs)
        started.append(popen.pid)
        return popen

    monkeypatch.setattr(subprocess, "Popen", recording_popen)
    starter = RankStarter({"a": 1}, "tensor-parallel")
    assert starter.method == "exec"
    # (More than a pipe holds, so the send meets the exited reader.)
    with pytest.raises(EngineDeadError, match=r"tensor-parallel worker rank 1 exited \(code -?\d"):
        starter.start(1, (b"x" * (4 << 20),), None, [])
    assert len(started) == 1
    # Reaped: the rank's pid is no longer a child of this process (other tests' children,
    # if any linger, do not matter here).
    with pytest.raises(ChildProcessError):
        os.waitpid(started[0], os.WNOHANG)


def test_workers_use_multiprocessings_executable_and_only_the_scripts_path(checkpoint, tmp_path):
    """``multiprocessing.set_executable()`` is respected, and the worker imports nothing
    but the standard library before it has the script's ``sys.path``: here the
    interpreter runs with ``-S`` (no site-packages: no pluggy, no torch until then)."""
    marker = tmp_path / "started"
    wrapper = tmp_path / "python-wrapper"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {marker}\nexec {sys.executable} -S "$@"\n')
    wrapper.chmod(0o755)
    source = f"import multiprocessing\nmultiprocessing.set_executable({str(wrapper)!r})\n"
    result = _run_script(tmp_path, source + UNGUARDED, checkpoint, 2, 1)
    assert _tokens(result) == checkpoint[2]
    assert marker.read_text().startswith("-c "), marker.read_text()


# Builds the starter of a tensor-parallel group whose configuration refers to a function
# of __main__ (as an hf_overrides function defined in the script), unguarded.
STARTER = """\
import torch
from pagedllm.executors.worker_start import RankStarter
def overrides(config):
    return config
if {cuda}:
    torch.cuda.init()
RankStarter({{"hf_overrides": overrides}}, "tensor-parallel")
print("STARTED")
"""


def _run_starter(tmp_path: Path, cuda: bool, as_file: bool, **env: str):
    source = STARTER.format(cuda=cuda)
    environment = clean_env(**env)
    environment.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
    environment.update(env)
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    script = tmp_path / "starter.py"
    script.write_text(source)
    command = [str(script)] if as_file else ["-c", source]
    return subprocess.run(
        [sys.executable, *command],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=environment,
        timeout=300,
    )


def test_script_objects_without_a_script_file_are_refused_at_once(tmp_path):
    """``python -c`` (or a notebook): no worker can find __main__'s function, so the
    engine refuses at once, naming it, rather than its workers dying on unpickling."""
    result = _run_starter(tmp_path, cuda=False, as_file=False)
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("pagedllm.core.errors.ConfigError: "), result.stderr[-3000:]
    assert "refers to __main__.overrides, defined in __main__, which has no file" in error
    assert "define overrides in an importable module" in error
    assert "STARTED" not in result.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (initialised)")
def test_fork_with_cuda_and_script_objects_advises_the_module(tmp_path):
    """fork with CUDA initialised falls back to a new interpreter, then to spawn for the
    script's function: the advice is to move the function, not to unset the variable
    (which would not help)."""
    result = _run_starter(
        tmp_path, cuda=True, as_file=True, PAGEDLLM_WORKER_MULTIPROC_METHOD="fork"
    )
    error = result.stderr.strip().splitlines()[-1]
    assert "refers to __main__.overrides, defined in the script" in error, result.stderr[-3000:]
    assert "define them in a module" in error
    assert "unset the variable" not in error
