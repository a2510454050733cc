"""The command line as a user runs it (``python -m simplefsdp train`` on local ranks), and the shape of the package:
no import cycles, the CLI imported by no library module, no file over 400 lines."""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest
from charts import png_size

from simplefsdp import names
from simplefsdp.bench.contenders import CONTENDERS
from simplefsdp.cli import build_parser, main
from simplefsdp.ir.hardware import BUILT_IN
from simplefsdp.models.llama import CONFIGS


def run_cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "simplefsdp", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_the_launcher_loads_no_compiler_and_an_eager_model_no_inductor_compiler():
    """``python -m simplefsdp train`` imports what its launcher needs, not Dynamo (which ranks import again); an eager
    rank loads Dynamo (DTensor's ``distribute_tensor`` imports it) but not Inductor's compiler: seconds of CPU per
    process. Compiling loads it."""
    loaded = "print(sorted(name for name in COMPILER if name in sys.modules))"
    code = ("import sys, torch; COMPILER = ('torch._dynamo', 'torch._inductor.compile_fx'); "
            f"import simplefsdp.cli, simplefsdp.train; {loaded}; from simplefsdp import compile_sharded; "
            "model = compile_sharded(torch.nn.Linear(4, 4), compile=False); model(torch.ones(2, 4)).sum().backward(); "
            f"{loaded}")
    eager = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert eager.stdout.splitlines() == ["[]", "['torch._dynamo']"], eager.stderr[-3000:]
    compiled = subprocess.run([sys.executable, "-c", code.replace("compile=False", "backend='eager'")],
                              capture_output=True, text=True, timeout=120)
    modules_loaded = compiled.stdout.splitlines()[-1]
    assert modules_loaded == "['torch._dynamo', 'torch._inductor.compile_fx']", compiled.stderr[-3000:]


@pytest.mark.parametrize("command", ["", "train", "inspect", "bench"])
def test_help_imports_no_torch(command):
    """``python -m simplefsdp [COMMAND] --help`` builds its parser from plain names: it answers at once."""
    code = ("import runpy, sys; sys.argv = ['simplefsdp', *sys.argv[1:], '--help']\n"
            "try: runpy.run_module('simplefsdp', run_name='__main__')\n"
            "except SystemExit: pass\n"
            "print('loaded:', sorted(name for name in sys.modules if name.split('.')[0] == 'torch'))")
    result = subprocess.run([sys.executable, "-c", code, *command.split()], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: simplefsdp {command}".rstrip()), result.stdout
    assert result.stdout.splitlines()[-1] == "loaded: []"


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    subparsers = next(action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction))
    return subparsers.choices


def help_entries(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's entry in ``parser``'s help as a user reads it, on one line, by its first option string."""
    entries, option = {}, None
    for line in parser.format_help().splitlines():
        if line.startswith("  -"):
            option = line.split()[0].rstrip(",")
            entries[option] = line.strip()
        elif line.startswith("   ") and option:
            entries[option] += " " + line.strip()
    return entries


@pytest.mark.parametrize("command", ["train", "inspect", "bench"])
def test_every_option_is_in_a_named_group_with_help_that_shows_its_default(command):
    parser = command_parsers()[command]
    ungrouped = [action.dest for group in parser._action_groups if group.title == "options"
                 for action in group._group_actions]
    assert ungrouped == ["help"]
    entries = help_entries(parser)
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or action.dest == "help":
            continue
        assert action.help, action.option_strings
        if action.nargs != 0:  # a flag is off unless given; any other option says what it is without it
            assert "(default: " in entries[action.option_strings[0]], entries[action.option_strings[0]]


def test_the_learning_rates_default_is_the_optimizers():
    assert help_entries(command_parsers()["train"])["--lr"].endswith("(default: 0.001 with adamw, 0.01 with galore)")
    assert help_entries(command_parsers()["bench"])["--lr"].endswith("(default: 0.001 with adamw)")


def test_the_command_lines_names_agree_with_the_modules_that_use_them():
    assert names.MODEL_NAMES == tuple(CONFIGS)
    assert names.PROFILE_NAMES == (*BUILT_IN, "cpu")
    assert names.CONTENDER_NAMES == tuple(contender.name for contender in CONTENDERS)


def test_model_takes_any_name_and_an_unknown_one_is_refused_before_anything_runs(capsys):
    assert build_parser().parse_args(["train", "--model", "my_models.tiny:build"]).model == "my_models.tiny:build"
    for command in ("train", "inspect", "bench"):
        with pytest.raises(SystemExit, match=rf"simplefsdp {command}: --model gpt5: not a reference model \(debug, "
                                             r"cpu-small, .*\), hf:PATH .* or package.module:function"):
            main([command, "--model", "gpt5"])


def test_train_on_two_ranks_from_a_text_file_announces_compilation_and_plots_the_loss_without_warnings(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    result = run_cli(
        "train", "--model", "debug", "--nproc", "2", "--steps", "3", "--batch-size", "2", "--seq-len", "32",
        "--backend", "aot_eager", "--data", str(data), "--plot", str(tmp_path / "loss.png"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "on 2 rank(s), mode fully_shard" in result.stdout
    steps = re.findall(r"^step +(\d+)/3 +loss (\d+\.\d+) +[\d,]+ tok/s", result.stdout, flags=re.M)
    assert [int(step) for step, _ in steps] == [1, 2, 3]
    # compilation is announced before the first step and timed after it
    assert re.search(r"^compiling the forward and backward graphs in the first step \.\.\.\ncompiled in \d+\.\d s\n"
                     r"step +1/3 ", result.stdout, flags=re.M), result.stdout
    assert re.search(r"^summary: loss \d+\.\d+ -> \d+\.\d+ over steps 1-3;", result.stdout, flags=re.M)
    assert f"wrote {tmp_path / 'loss.png'}" in result.stdout
    assert png_size(tmp_path / "loss.png") == (800, 450)
    assert "Warning" not in result.stderr, result.stderr


def test_a_first_run_from_empty_caches_says_it_compiled_every_graph_and_a_second_that_it_loaded_them(tmp_path):
    """A new user's first run, on 2 ranks: one rank compiles each graph and the other loads it from Inductor's cache
    (``InductorOncePerHost``), whichever reaches it first. The line counts a graph any rank compiled as compiled;
    it counted rank 0's own loads before, and said ``2 of 2 graphs from Inductor's cache`` in 3 of 9 such runs
    here, where rank 1 had compiled them."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "SIMPLEFSDP_CACHE": str(tmp_path)}
    counts = []
    for _ in range(2):
        result = run_cli("train", "--model", "debug", "--nproc", "2", "--steps", "1", "--seq-len", "16", env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        line = re.search(r"^compiled in \d+\.\d s \((\d+) of (\d+) graphs from Inductor's cache\)$", result.stdout,
                         flags=re.M)
        assert line, result.stdout
        counts.append((int(line[1]), int(line[2])))
    (cold, graphs), (warm, graphs_again) = counts
    assert graphs > 0 and (cold, warm, graphs_again) == (0, graphs, graphs)


def test_bad_dtype_names_the_choices():
    result = run_cli("train", "--param-dtype", "int8")
    assert result.returncode == 2
    assert "unknown dtype 'int8'; choose one of: float32, bfloat16, float16" in result.stderr


@pytest.mark.parametrize("command", ["train", "inspect"])
def test_bad_bucket_mode_names_the_choices_in_every_command_that_shards(command, capsys):
    with pytest.raises(SystemExit) as error:
        main([command, "--buckets", "blocks"])
    assert error.value.code == 2
    assert "unknown bucket mode 'blocks'; choose one of: auto, block, none" in capsys.readouterr().err


def test_layers_keeps_the_named_shape_with_fewer_blocks(capsys):
    assert main(["inspect", "--model", "debug", "--layers", "1", "--world-size", "2"]) == 0
    summary = capsys.readouterr().out
    assert summary.startswith("debug (layers=1), fully_shard, world 2")
    assert "layers.0.feed_forward.w2" in summary and "layers.1." not in summary, summary
    with pytest.raises(SystemExit) as error:
        main(["train", "--layers", "0"])
    assert error.value.code == 2
    assert "argument --layers: '0' is not a whole number of at least 1" in capsys.readouterr().err


PACKAGE = Path(__file__).resolve().parents[1] / "simplefsdp"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each module of simplefsdp and the simplefsdp modules it imports anywhere in its body (functions included)."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                # `from simplefsdp import bench` imports the module simplefsdp.bench, not a name of simplefsdp
                imported.update(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules
                                else node.module for alias in node.names)
        graph[name] = {module for module in imported if module in modules and module != name}
    return graph


def test_import_graph_sees_function_level_imports():
    graph = import_graph()
    assert "simplefsdp.names" in graph["simplefsdp.cli"]  # a module-level import
    assert "simplefsdp.runtime.sharding" in graph["simplefsdp.inspection"]


def test_no_module_of_simplefsdp_imports_in_a_cycle():
    graph = nx.DiGraph([(module, imported) for module, targets in import_graph().items() for imported in targets])
    assert nx.is_directed_acyclic_graph(graph), nx.find_cycle(graph)


def test_only_the_entry_points_import_the_command_line_module():
    importers = {module for module, imported in import_graph().items() if "simplefsdp.cli" in imported}
    assert importers == {"simplefsdp.__main__"}


def test_no_file_of_simplefsdp_is_over_400_lines():
    lengths = {str(path.relative_to(PACKAGE)): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    assert {path: lines for path, lines in lengths.items() if lines > 400} == {}
