"""The `hotloop` command line.

Only argparse is imported at module level: every command imports the module that runs it
(`apps.*`, `benchmarks.*`) inside its function, so `hotloop --help` is instant (torch, vLLM,
peft and Ray take seconds to import). Those are plain imports, so the layering test sees them.
"""

from __future__ import annotations

import argparse
import os
import sys

SERVICES = ["rollout", "reward", "reference", "gateway"]
# `hotloop up --profile NAME`: which services a profile starts.
PROFILES = {
    "full": SERVICES,
    "colocated": ["rollout", "reward", "gateway"],
}


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config file (see configs/)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set model.name=/path/to/model")


def _bench_parser(bsub, name: str, what: str, *, config: bool = False, model: bool = False,
                  dtype: bool = False) -> argparse.ArgumentParser:
    """`hotloop bench <name>` with the arguments benchmarks share (`--json` is added to all)."""
    p = bsub.add_parser(name, help=what)
    if config:
        _config_args(p)
    if model:
        p.add_argument("--model", default="smollm2-135m-instruct")
    if dtype:
        p.add_argument("--dtype", default="auto", help="auto | bfloat16 | float32")
    return p


def _out_dir(p: argparse.ArgumentParser, prefix: str) -> None:
    p.add_argument("--out-dir", default="runs", help=f"the run's files go under OUT_DIR/{prefix}-<time>")


def cmd_models(args) -> int:
    from hotloop import models

    if args.action == "list":
        for name, km in models.KNOWN_MODELS.items():
            target = models.cache_dir() / name
            state = "pulled" if (target / models.MANIFEST).exists() else "not pulled"
            print(f"{name:28s} {state:11s} {km.description}")
        print(f"cache: {models.cache_dir()}")
        return 0
    path = models.pull(args.name, force=args.force)
    print(path)
    return 0


def cmd_config(args) -> int:
    from launch import sections
    from hotloop import configdoc
    from hotloop.config import ConfigError

    if args.defaults and (args.config or args.set):
        raise ConfigError(["--defaults prints the defaults alone: leave out --config and --set"])
    print(configdoc.defaults(sections.sections()) if args.defaults
          else configdoc.effective(sections.sections(), args.config, args.set), end="")
    return 0


def replica_overrides(text: str | None) -> list[str]:
    """`--replicas rollout=2,reward=2` as the overrides it stands for (`up.replicas.<name>=N`);
    the counts are checked with the rest of `[up]`. ValueError for a malformed item."""
    from launch.mesh import REPLICATED

    out = []
    for item in filter(None, (text or "").split(",")):
        name, eq, count = item.strip().partition("=")
        if not eq or not count.strip():
            raise ValueError(f"--replicas {text}: {item!r} is not SERVICE=N (e.g. --replicas rollout=2,reward=2)")
        if name.strip() not in REPLICATED:
            raise ValueError(f"--replicas {text}: {name.strip()!r} does not run as replicas; "
                             f"those that do: {', '.join(REPLICATED)}")
        out.append(f"up.replicas.{name.strip()}={count.strip()}")
    return out


def cmd_up(args) -> int:
    from launch import sections
    from launch.mesh import ALL_SERVICES, Mesh, available

    try:
        overrides = [*args.set, *replica_overrides(args.replicas)]
    except ValueError as e:
        print(f"hotloop up: {e}", file=sys.stderr)
        return 2
    # Every section of the file checked now, before anything starts: all problems at once.
    loaded = sections.load(args.config, overrides)
    mesh_cfg = loaded.mesh
    # Explicitly named services must all exist; the default is every one that does.
    if args.services and args.profile:
        print("hotloop up: give --services or --profile, not both", file=sys.stderr)
        return 2
    if args.profile:
        services = [s for s in PROFILES[args.profile] if available(s)]
    else:
        services = args.services.split(",") if args.services else [s for s in ALL_SERVICES if available(s)]
    try:
        mesh = Mesh(mesh_cfg, args.config, overrides, services, up=loaded["up"],
                    rollout=loaded["rollout"])
    except ValueError as e:
        print(f"hotloop up: {e}", file=sys.stderr)
        return 2
    info = mesh.start()
    print(f"[hotloop up] mesh is up: {info.endpoints}; mesh file {info.run_dir}/mesh.json. Ctrl-C stops it.",
          flush=True)
    return mesh.watch()


def cmd_serve(args) -> int:
    from launch.mesh import available

    if not available(args.service):
        print(f"service {args.service!r} is not available", file=sys.stderr)
        return 2
    os.execv(sys.executable, [sys.executable, "-m", f"services.{args.service}", *args.rest])
    return 0  # not reached


def command_main(command: str, bench: str = ""):
    """The `main(args)` of `hotloop <command>` (`hotloop bench <bench>`) where its body is a
    module of its own (the others are above), imported only when asked for."""
    name = f"bench {bench}" if command == "bench" else command
    if name == "train":
        from apps.train import train as main
    elif name == "eval":
        from apps.train import evaluate as main
    elif name == "trace":
        from apps.tracebudget import main
    elif name == "demo":
        from apps.demo import main
    elif name == "simulate":
        from apps.simulate import main
    elif name == "demo-online":
        from apps.online_demo import main
    elif name == "demo-tenants":
        from apps.tenant_demo import main
    elif name == "audit":
        from apps.audit import main
    elif name == "bench rollout":
        from benchmarks.rollout import main
    elif name == "bench hot-update":
        from benchmarks.hot_update import main
    elif name == "bench sandbox":
        from benchmarks.sandbox import main
    elif name == "bench threads":
        from benchmarks.threads import main
    elif name == "bench joint":
        from benchmarks.joint import main
    elif name == "bench train-step":
        from benchmarks.train_step import main
    elif name == "bench online-step":
        from benchmarks.online_step import main
    elif name == "bench grpo":
        from benchmarks.grpo import main
    elif name == "bench update-loop":
        from benchmarks.update_loop import main
    elif name == "bench tenants":
        from benchmarks.tenants import main
    else:
        raise KeyError(f"no command `hotloop {name}`")
    return main


def run_module(args) -> int:
    return command_main(args.command, getattr(args, "bench", ""))(args)


class _Parser(argparse.ArgumentParser):
    """A command's parser that may fill itself in when parsing reaches it (`fill`), so that
    what it needs to read is read only for that command: `hotloop --help` stays instant."""

    fill = None

    def parse_known_args(self, args=None, namespace=None):
        if self.fill is not None:
            fill, self.fill = self.fill, None
            fill(self)
        return super().parse_known_args(args, namespace)


def _train_recipes(t: argparse.ArgumentParser) -> None:
    """`hotloop train <recipe>`, one per recipe the trainer's registry lists (reading it
    imports the recipe modules: pydantic, gRPC, OpenTelemetry, never torch)."""
    from services.trainer.recipes.registry import recipes

    tsub = t.add_subparsers(dest="algorithm", required=True, metavar="RECIPE")
    for entry in recipes().values():
        ta = tsub.add_parser(entry.name, help=entry.help)
        _config_args(ta)
        ta.add_argument("--run-dir", help="mesh run directory (default: from config)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hotloop",
        description="RL fine-tuning (GRPO, PPO) of LLMs around a serving engine with hot LoRA updates.",
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    m = sub.add_parser("models", help="provision models")
    msub = m.add_subparsers(dest="action", required=True)
    pull = msub.add_parser("pull", help="provision a model into the cache as a Hugging Face directory")
    pull.add_argument("name", nargs="?", default="smollm2-135m-instruct",
                      help="known name, local HF directory, or hub id")
    pull.add_argument("--force", action="store_true", help="re-provision even if cached")
    msub.add_parser("list", help="known models and whether they are pulled")
    m.set_defaults(fn=cmd_models)

    c = sub.add_parser("config", help="the configuration a command runs with, key by key")
    csub = c.add_subparsers(dest="action", required=True)
    cs = csub.add_parser("show", help="every section and key: value, default, source (file, environment, "
                         "--set or default) and docstring, as annotated TOML")
    _config_args(cs)
    cs.add_argument("--defaults", action="store_true",
                    help="every key at its default instead: a complete config file that loads as is")
    c.set_defaults(fn=cmd_config)

    up = sub.add_parser("up", help="start NATS and every service on loopback; Ctrl-C stops all")
    _config_args(up)
    up.add_argument("--services", help=f"comma-separated subset of {SERVICES}")
    up.add_argument("--profile", choices=sorted(PROFILES),
                    help="a named set of services: `colocated` leaves the reference out (PPO scores "
                         "its KL against the base inside the trainer, so the base is loaded once)")
    up.add_argument("--replicas", metavar="SERVICE=N,...",
                    help="processes of rollout, reference and reward, each on its own port with its own "
                         "restarts, e.g. rollout=2,reference=2,reward=2 ([up] replicas); jobs spread their "
                         "work over them")
    up.set_defaults(fn=cmd_up)

    serve = sub.add_parser("serve", help="run one service in the foreground (as compose does)")
    # the online trainer too: compose runs it as a service that replicas fetch versions from
    serve.add_argument("service", choices=[*SERVICES, "trainer"])
    serve.add_argument("rest", nargs=argparse.REMAINDER, help="--config F --set K=V --port-file F")
    serve.set_defaults(fn=cmd_serve)

    b = sub.add_parser("bench", help="benchmarks that print ratios against a baseline measured in the same run")
    bsub = b.add_subparsers(dest="bench", required=True)
    br = _bench_parser(bsub, "rollout", "tokens/s of vLLM with/without a fresh adapter against a matmul "
                       "roofline and HF generate (per prompt, batched) measured in the same run", model=True)
    br.add_argument("--prompts", type=int, default=8)
    br.add_argument("--n", type=int, default=8)
    br.add_argument("--max-tokens", type=int, default=128)
    br.add_argument("--repeats", type=int, default=3)
    br.add_argument("--lora-slot", action="store_true",
                    help="also measure vLLM LoRA slots (very slow on the CPU backend)")
    br.add_argument("--no-hf", action="store_true",
                    help="skip the HF generate baselines (the roofline ratio needs none)")
    br.add_argument("--tenants", type=int, default=0,
                    help="also run the workload with its prompts spread evenly over this many "
                         "tenants' adapters in one engine (adapter slots), against one merged "
                         "adapter in the same run")
    bh = _bench_parser(bsub, "hot-update", "push-to-first-token latency of new versions under load", model=True)
    bh.add_argument("--pushes", type=int, default=20)
    bh.add_argument("--mode", choices=["merged", "lora", "auto"], default="auto")
    bh.add_argument("--rank", type=int, default=16)
    bh.add_argument("--swap", choices=["inflight", "drain"],
                    help="merged mode: measure one swap (default: both, on separate engines)")
    bs = _bench_parser(bsub, "sandbox", "scored samples/s: local process pool vs Ray actors")
    bs.add_argument("--samples", type=int, default=64)
    bt = _bench_parser(bsub, "threads", "A/B of OpenMP wait policy and thread binding: engine tok/s and "
                       "trainer step time beside an idle engine", model=True, dtype=True)
    bt.add_argument("--threads", type=int, default=2, help="trainer torch threads")
    bt.add_argument("--steps", type=int, default=3, help="timed LoRA steps per setting (median)")
    bj = _bench_parser(bsub, "joint", "users through the gateway alone, then beside PPO training: TTFT/ITL "
                       "p50/p99 per users-first policy, and PPO samples/s", config=True)
    # 4 users with 32-token answers give >= 200 requests a phase (a p99 that rests on more
    # than the slowest one or two), and 240 s holds two PPO steps on 2 CPU cores
    bj.add_argument("--users", type=int, default=4, help="concurrent simulated users (openai client)")
    bj.add_argument("--phase-s", type=float, default=240.0, help="seconds of each phase (idle, each policy)")
    bj.add_argument("--policies", default="none,pause",
                    help="users-first policies to measure beside training ([ppo] users_first)")
    bj.add_argument("--max-tokens", type=int, default=32, help="users' answer length")
    _out_dir(bj, "bench-joint")
    bts = _bench_parser(bsub, "train-step", "LoRA step tokens/s against a matmul FLOP roofline measured in "
                        "the same run", model=True, dtype=True)
    bts.add_argument("--samples", type=int, default=16, help="sequences per step")
    bts.add_argument("--prompt-tokens", type=int, default=64)
    bts.add_argument("--completion-tokens", type=int, default=128)
    bts.add_argument("--group-size", type=int, default=1,
                     help="samples per prompt (GRPO's G); above 1 also times the step with "
                          "share_prompts off, in the same run")
    bts.add_argument("--micro-batch-tokens", type=int, default=2048,
                     help="the trainer's micro_batch_tokens (the demo's: 2048)")
    bts.add_argument("--steps", type=int, default=3, help="timed steps (median)")
    bts.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    bts.add_argument("--top-layers", type=int, default=None,
                     help="LoRA on the top N decoder layers only ([trainer.lora] top_layers; "
                          "default: every layer)")
    bts.add_argument("--ranks", type=int, default=1,
                     help="also run the step on N data-parallel ranks ([trainer] data_parallel) "
                          "from the same state: both step times and max_param_diff")
    bts.add_argument("--colocated-reference", action="store_true",
                     help="also time the colocated reference both ways: base_logprobs then "
                          "the step, against the step scoring it from the layers below "
                          "--top-layers run once")
    bos = _bench_parser(bsub, "online-step", "one online update (train + pack) per batch of ratings, on "
                        "the CPU and on CUDA in the same run: ms per rating, ratings/s", config=True)
    bos.add_argument("--devices", default="", help="comma-separated: cpu, cuda (default: cpu, and "
                     "cuda when this host has one)")
    bos.add_argument("--batches", default="1,2,4,8", help="ratings per update (the online "
                     "recipe's batch_size is the most it takes)")
    bos.add_argument("--prompt-tokens", type=int, default=48, help="tokens of each rated prompt")
    bos.add_argument("--completion-tokens", type=int, default=96, help="tokens of each rated answer")
    bos.add_argument("--updates", type=int, default=5, help="timed updates per batch size (median)")
    bos.add_argument("--shape", help="train a random-weight Llama of this shape (smollm2-135m, "
                     "qwen2.5-0.5b, llama-3.2-1b), not the config's model: no download")
    bos.add_argument("--cpu-threads", type=int, default=None,
                     help="torch threads ([trainer] torch_threads; the shipped configs give "
                          "the trainer 1 core)")
    bg = _bench_parser(bsub, "grpo", "GRPO samples/s, seconds per stage and idle share of the cores, "
                       "synchronous vs asynchronous on the demo configuration; --peer trl adds TRL", config=True)
    bg.add_argument("--steps", type=int, default=4, help="steps of each mode (the first is start-up)")
    bg.add_argument("--max-staleness", type=int, default=1, help="the asynchronous mode's bound")
    bg.add_argument("--peer", choices=["trl"], help="also run TRL's GRPOTrainer (pip install -e '.[peer]')")
    bg.add_argument("--peer-steps", type=int, default=3, help="TRL optimizer steps (median of all but the first)")
    bg.add_argument("--replicas", type=int, default=1, choices=range(1, 17), metavar="N",
                    help="processes of each service (rollout, reference, reward) the steps spread over; "
                         "reports each replica's share and any work lost or done twice")
    _out_dir(bg, "bench-grpo")
    bu = _bench_parser(bsub, "update-loop", "feedback sent -> first token from a version trained on it, "
                       "with users streaming; stage budget from the traces", config=True)
    bu.add_argument("--loops", type=int, default=30)
    bu.add_argument("--users", type=int, default=2, help="background users streaming meanwhile")
    bu.add_argument("--max-tokens", type=int, default=64, help="background answers' length")
    bu.add_argument("--max-words", type=int, default=70, help="the users' hidden preference")
    bu.add_argument("--loop-timeout-s", type=float, default=60.0, help="count a feedback lost after this")
    _out_dir(bu, "update-loop")
    bten = _bench_parser(bsub, "tenants", "many tenants on one engine, per tenant count in one run: "
                         "users' TTFT and tokens/s while every tenant gets new versions, push-to-"
                         "first-token loops, slot loads and evictions, wrong-adapter answers, and "
                         "batch tokens/s against one merged adapter", model=True)
    bten.add_argument("--tenant-counts", default="1,4,16", help="comma-separated, one run each")
    bten.add_argument("--tenant-slots", type=int, default=4,
                      help="[rollout] tenant_slots (fewer than tenants: evictions)")
    bten.add_argument("--users", type=int, default=4, help="concurrent simulated users")
    bten.add_argument("--duration-s", type=float, default=30.0,
                      help="seconds of users and pushes per tenant count")
    bten.add_argument("--push-every-s", type=float, default=10.0,
                      help="a new version for each tenant this often")
    bten.add_argument("--max-tokens", type=int, default=64, help="users' answer length")
    bten.add_argument("--prompts", type=int, default=8, help="batch workload (bench rollout's)")
    bten.add_argument("--n", type=int, default=8, help="batch workload: samples per prompt")
    bten.add_argument("--batch-max-tokens", type=int, default=128,
                      help="batch workload: tokens per sample")
    bten.add_argument("--repeats", type=int, default=1, help="batch workload runs (median)")
    bten.add_argument("--slot-wait-s", type=float, default=120.0,
                      help="[rollout] tenant_slot_wait_s (the batch over more tenants than slots "
                           "waits for slots in turn)")
    bten.add_argument("--plot", metavar="PNG", help="also plot TTFT and batch tokens/s here")
    for bench in bsub.choices.values():
        bench.add_argument("--json", help="write results here")
    b.set_defaults(fn=run_module)

    t = sub.add_parser("train", help="run a training job against a running mesh")
    t.set_defaults(fn=run_module)
    t.fill = _train_recipes  # one subcommand per recipe, once parsing reaches `train`

    e = sub.add_parser("eval", help="pass@k of a policy version on held-out tasks or HumanEval")
    _config_args(e)
    e.add_argument("--tasks", default="builtin", help="builtin | humaneval | path/to/tasks.jsonl")
    e.add_argument("--split", default="test", help="builtin: train | test | all")
    e.add_argument("--version", type=int, default=0, help="policy version (0: base model)")
    e.add_argument("--samples", type=int, default=4, help="samples per task")
    e.add_argument("--limit", type=int, default=0, help="first N tasks only")
    e.add_argument("--k", type=int, action="append", help="report pass@k (repeatable)")
    e.set_defaults(fn=run_module)

    tr = sub.add_parser("trace", help="turn traces into a latency budget")
    trs = tr.add_subparsers(dest="action", required=True)
    tb = trs.add_parser("budget", help="time and share per stage from JSON-lines trace files")
    tb.add_argument("paths", nargs="+", help="trace .jsonl files or directories")
    tb.add_argument("--root", default="", help="span name of the loop (default: the longest roots)")
    tr.set_defaults(fn=run_module)

    d = sub.add_parser("demo", help="start the mesh and run the GRPO demo, then write a report")
    _config_args(d)
    d.set_defaults(fn=run_module)

    sim = sub.add_parser("simulate", help="simulated users against a running gateway")
    simsub = sim.add_subparsers(dest="what", required=True)
    su = simsub.add_parser("users", help="N users chat (streaming) and rate answers by a hidden preference")
    _config_args(su)
    su.add_argument("--run-dir", help="mesh run directory (default: from config)")
    su.add_argument("--base-url", help="a gateway URL instead of the mesh's (with --key)")
    su.add_argument("--key", help="the API key for --base-url")
    su.add_argument("--users", type=int, default=4)
    su.add_argument("--requests", type=int, default=0, help="requests per user (default 10 without --duration)")
    su.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds")
    su.add_argument("--rate", type=float, default=0.0, help="requests per second, all users (0: no limit)")
    su.add_argument("--max-tokens", type=int, default=128)
    su.add_argument("--max-words", type=int, default=70, help="the hidden preference: answers of at most N words")
    su.add_argument("--no-feedback", action="store_true", help="score locally, send no feedback")
    su.add_argument("--seed", type=int, default=0)
    su.add_argument("--progress", type=float, default=5.0, help="seconds between progress lines (0: none)")
    su.add_argument("--out", default="runs/simulate/requests.jsonl", help="per-request JSONL (appended)")
    sim.set_defaults(fn=run_module)

    do = sub.add_parser("demo-online", help="users, gateway and the online trainer: the share of answers "
                        "matching a hidden preference rises; writes runs/<id>/online-report.md")
    _config_args(do)
    do.add_argument("--users", type=int, default=4)
    do.add_argument("--idle-s", type=float, default=60.0, help="users only, no training: base rate, idle latency")
    do.add_argument("--train-s", type=float, default=600.0, help="longest training phase")
    do.add_argument("--no-stop", action="store_true", help="keep training after the target is reached")
    do.add_argument("--max-tokens", type=int, default=128)
    do.add_argument("--max-words", type=int, default=70, help="the hidden preference: answers of at most N words")
    do.add_argument("--window", type=int, default=40, help="answers in the sliding share")
    do.add_argument("--progress", type=float, default=10.0, help="seconds between progress lines")
    do.add_argument("--out-dir", default="runs")
    do.add_argument("--run-id", default="", help="default: online-<time>")
    do.add_argument("--quiet", action="store_true", help="no mesh start-up lines")
    do.set_defaults(fn=run_module)

    dt = sub.add_parser("demo-tenants", help="three tenants on one engine, each with users of a different "
                        "hidden preference and its own lineage learning it; writes runs/<id>/tenants-report.md")
    _config_args(dt)
    dt.add_argument("--users", type=int, default=3, help="users per tenant")
    dt.add_argument("--idle-s", type=float, default=60.0, help="users only, no training: base rates")
    dt.add_argument("--idle-answers", type=int, default=300,
                    help="and until the tenants' idle answers together number N (the base rates' sample)")
    dt.add_argument("--train-s", type=float, default=900.0, help="longest training phase")
    dt.add_argument("--no-stop", action="store_true",
                    help="train the whole --train-s, also after every tenant reached its target")
    dt.add_argument("--keep-rating", action="store_true",
                    help="a tenant at its target keeps rating (the shared trainer's fair share keeps "
                         "it from starving the others); by default it stops rating, its users keep "
                         "asking, and its lineage stays where it met its target")
    dt.add_argument("--target-factor", type=float, default=2.0,
                    help="a tenant's target: N x its preference's base rate (at most 0.8)")
    dt.add_argument("--kl-beta", type=float, default=0.1,
                    help="the KL penalty to the base model (sets [trainer.loss] kl_beta; its "
                         "reference logprobs come from the trainer's own base model): it keeps "
                         "each lineage near the base model beside what its users reward")
    dt.add_argument("--lr", type=float, default=2e-3,
                    help="the LoRA learning rate (sets [trainer.optimizer] lr)")
    dt.add_argument("--max-tokens", type=int, default=128)
    dt.add_argument("--max-words", type=int, default=60, help="tenant `short`: answers of at most N words")
    dt.add_argument("--min-words", type=int, default=15,
                    help="tenant `short`: and at least N words (an empty or one-line reply like "
                         "\"I can help you with that!\" is not a short answer)")
    dt.add_argument("--tenants", default="",
                    help="the tenants, each named after its users' preference, comma-separated "
                         "(default short,direct,exclaim: direct's first sentence says 'you'; "
                         "also bullets: lists; question: it ends with a question)")
    dt.add_argument("--min-items", type=int, default=2, help="tenant `bullets`: lists of at least N items")
    dt.add_argument("--min-item-words", type=int, default=4,
                    help="tenant `bullets`: items of at least N words (a list of one-word items is "
                         "a short answer too)")
    dt.add_argument("--window", type=int, default=30,
                    help="a tenant's answers of training are read in blocks of N: once one meets "
                         "its target by one standard error, its users pause rating and its "
                         "version is checked")
    dt.add_argument("--check-answers", type=int, default=40,
                    help="a check: N answers of the version a paused tenant serves; at its target "
                         "by 1.5 standard errors, its users stop rating; below, they rate again")
    dt.add_argument("--eval-answers", type=int, default=60,
                    help="after training, users only until every tenant's final version gave N answers "
                         "since its lineage stopped learning: the final shares (0: no evaluation)")
    dt.add_argument("--trainers", choices=["auto", "per-tenant", "shared"], default="auto",
                    help="a trainer process per tenant, or one for all (where the trainer has "
                         "[online] tenants); auto: shared where possible")
    dt.add_argument("--progress", type=float, default=10.0, help="seconds between status lines")
    dt.add_argument("--out-dir", default="runs")
    dt.add_argument("--run-id", default="", help="default: tenants-<time>")
    dt.add_argument("--quiet", action="store_true", help="no mesh start-up lines")
    dt.add_argument("--audit-answers", type=int, default=20,
                    help="at the end, each tenant's adapter is exported and N of its answers are "
                         "scored under every tenant's adapter and the base (`hotloop audit tenants`; "
                         "0: no audit)")
    dt.set_defaults(fn=run_module)

    au = sub.add_parser("audit", help="check a run's answers against the weights that should have "
                        "written them")
    ausub = au.add_subparsers(dest="what", required=True)
    at = ausub.add_parser("tenants", help="a tenant demo's run: score each tenant's answers under every "
                          "tenant's exported adapter and the base; exit 1 if another tenant's explains "
                          "any better than its own")
    at.add_argument("run", help="the run directory (runs/<id>, with adapters/ from the demo)")
    at.add_argument("--answers", type=int, default=20, help="answers sampled per tenant")
    at.add_argument("--margin", type=float, default=3.0,
                    help="nats by which another tenant's adapter must explain an answer better "
                         "than its own to count as served from it")
    at.add_argument("--model", default=None, help="the base model (default: the one the adapters name)")
    at.add_argument("--seed", type=int, default=0)
    at.set_defaults(fn=run_module)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None:  # a process of its own (not a test calling main): exit quickly
        from hotloop import quickexit

        quickexit.arm()
    from hotloop.config import ConfigError  # pydantic only, and only once a command runs

    try:
        return args.fn(args) or 0
    except ConfigError as e:  # a mistake in a file or a --set: said plainly, no traceback
        print(f"hotloop {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
