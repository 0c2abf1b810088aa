import subprocess
import sys


def test_help_imports_nothing_heavy():
    code = ("import sys, apps.cli as c\n"
            "try:\n    c.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'vllm', 'peft', 'ray', 'transformers') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out
    assert "models" in out and "bench" in out and "train" in out


def test_unknown_command_fails_clearly():
    r = subprocess.run([sys.executable, "-m", "apps.cli", "frobnicate"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "invalid choice" in r.stderr


def test_every_command_has_a_body():
    from apps.cli import command_main, build_parser, run_module

    def fns(parser):  # the `fn` of a parser, else of each of its subcommands
        if parser.get_default("fn") is not None:
            return [parser.get_default("fn")]
        subs = parser._subparsers._group_actions[0].choices.values() if parser._subparsers else []
        return [f for sub in subs for f in fns(sub)]

    commands = build_parser()._subparsers._group_actions[0].choices
    for name, sub in commands.items():
        assert fns(sub) and all(callable(f) for f in fns(sub)), name
        if run_module in fns(sub) and name != "bench":
            assert callable(command_main(name)), name


def test_every_bench_command_has_a_module_and_a_help():
    from apps.cli import build_parser, command_main

    bench = next(a for a in build_parser()._subparsers._group_actions[0].choices["bench"]._actions
                 if a.dest == "bench")
    assert set(bench.choices) >= {"rollout", "hot-update", "sandbox", "threads", "joint",
                                  "train-step", "grpo", "update-loop", "tenants"}
    for name in bench.choices:
        assert callable(command_main("bench", name)), name
        r = subprocess.run([sys.executable, "-m", "apps.cli", "bench", name, "--help"],
                           capture_output=True, text=True)
        assert r.returncode == 0 and f"hotloop bench {name}" in r.stdout, (name, r.stderr)
