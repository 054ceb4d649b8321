"""The ``jaxrunner`` command: generate, chat, serve, bench, convert, info.

Errors a user can cause (a bad flag value, a missing model) print one line and exit 2; a traceback
means a bug in jaxrunner.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import runpy
import sys
import time

from jaxrunner import __version__, kernels
from jaxrunner.config import DEFAULT_MODEL, DTYPES, KV_CACHE_DTYPES, EngineConfig
from jaxrunner.kernels.names import ATTENTION_IMPL_CHOICES, CPU_MATMUL_CHOICES
from jaxrunner.models.loading.resolve import ORBAX_MARKER, ModelNotFoundError, resolve_model
from jaxrunner.sampling_params import SamplingParams


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"alias, .gguf file, HF directory or jaxrunner checkpoint (default: {DEFAULT_MODEL})")
    parser.add_argument("--dtype", default="auto", choices=list(DTYPES),
                        help="compute dtype (auto: the checkpoint's where the device computes it natively; "
                             "on a CPU without bf16 dot products, float32)")
    parser.add_argument("--quantization", default=None, choices=["int8", "int4", "w4a8", "w8a8"],
                        help="linear-layer weights: int8/int4 weight-only (a 4-bit GGUF keeps its own blocks), "
                             "w4a8 (int4's weights, activations rounded to int8 per 32 inputs as llama.cpp "
                             "does), or w8a8 (int8 weights and activations); default: the dtype's floats")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=[c for c in KV_CACHE_DTYPES if c],
                        help="KV cache pages (auto: the compute dtype; fp8 / fp8_e4m3 / fp8_e5m2: one byte a "
                             "value, unscaled, half of bf16's memory and reads)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + output, in tokens (default: the model's limit, lowered to what "
                             "the KV cache holds)")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="most sequences in one step")
    parser.add_argument("--max-num-batched-tokens", type=int, default=256, help="token budget of one step")
    parser.add_argument("--attention-impl", default="auto", choices=list(ATTENTION_IMPL_CHOICES),
                        help="attention implementation (auto: pallas on GPU/TPU; on CPU native if a C++ compiler can build it, else xla)")
    parser.add_argument("--cpu-matmul", default="auto", choices=list(CPU_MATMUL_CHOICES),
                        help="CPU linear products (auto: per CPU kind where measured faster, float weights packed "
                             "for oneDNN, int8/int4 ones on oneDNN, the rest transposed for XLA's dot; xla: XLA's "
                             "dot on the weights as held; onednn: every float weight packed)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="devices that split the model")
    parser.add_argument("--data-parallel-size", type=int, default=1, help="engine replicas, each on its own devices")
    parser.add_argument("--coordinator-address", default=None,
                        help="multi-host: host:port of process 0 (default: $JAX_COORDINATOR_ADDRESS)")
    parser.add_argument("--num-processes", type=int, default=None, help="multi-host: processes in all "
                        "(default: $JAX_NUM_PROCESSES)")
    parser.add_argument("--process-id", type=int, default=None, help="multi-host: this process's index "
                        "(default: $JAX_PROCESS_ID)")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 3}\' '
                             'or \'{"model": DRAFT, "num_speculative_tokens": 3, "quantization": "int4"}\'')
    parser.add_argument("--verbose", action="store_true", help="log start-up details")


def _engine_options(args) -> dict:
    options = dict(dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens, attention_impl=args.attention_impl,
                   cpu_matmul=args.cpu_matmul, seed=getattr(args, "seed", 0), progress=sys.stderr.isatty(),
                   tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
                   quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    if args.speculative_config is not None:
        from jaxrunner.llm import speculative_config_options  # lazy: jaxrunner.llm loads JAX; --help must not

        try:
            config = json.loads(args.speculative_config)
        except json.JSONDecodeError as err:
            raise ValueError(f"--speculative-config: not JSON ({err.msg}); valid: a JSON object such as "
                             '\'{"method": "ngram", "num_speculative_tokens": 3}\'') from None
        options.update(speculative_config_options(config, options))
    return options


def _lora_options(args) -> dict:
    """``serve``'s LoRA flags as engine options (those not given keep the engine's defaults)."""
    options = {name: getattr(args, name) for name in ("max_loras", "max_lora_rank", "max_cpu_loras")
               if getattr(args, name) is not None}
    if args.enable_lora:
        options["enable_lora"] = True
    elif args.lora_modules or options:
        flag = "--lora-modules" if args.lora_modules else "--" + next(iter(options)).replace("_", "-")
        raise ValueError(f"{flag}: LoRA adapters need --enable-lora")
    return options


def _lora_module(text: str) -> tuple:
    """One --lora-modules item, as vLLM reads it: ``name=path``, or a JSON object with ``name``,
    ``path`` and optionally ``base_model_name``; (name, path, base_model_name or None)."""
    if not text.lstrip().startswith("{"):
        name, sep, path = text.partition("=")
        if not (sep and name and path):
            raise argparse.ArgumentTypeError(f"{text!r}: expected name=path or a JSON object "
                                             '{"name": ..., "path": ...}')
        return name, path, None
    try:
        item = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: not JSON ({err.msg})") from None
    if not isinstance(item, dict) or set(item) - {"name", "path", "base_model_name"} \
            or not all(isinstance(item.get(key), str) and item[key] for key in ("name", "path")) \
            or not isinstance(item.get("base_model_name", ""), str):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON object with the strings \"name\" and "
                                         '"path", and optionally "base_model_name"')
    return item["name"], item["path"], item.get("base_model_name")


def _narrowed_options(args, most_seqs: int) -> dict:
    """The engine flags, each checked as given, then ``max_num_seqs`` narrowed to ``most_seqs``: a
    command that knows how many sequences it will ever run compiles no wider bucket."""
    options = _engine_options(args)
    EngineConfig(model=args.model, **options)
    options["max_num_seqs"] = min(options["max_num_seqs"], most_seqs)
    return options


def _join_cluster(args) -> None:
    """Multi-host runs: every process runs the same command with its own --process-id."""
    from jaxrunner.parallel import distributed  # lazy: it loads JAX, which only commands that run a model need

    distributed.initialize_from_env(args.coordinator_address, args.num_processes, args.process_id)


def _start(model: str, options: dict):
    """Build the LLM and say, in two lines on stderr, what was loaded and how start-up went."""
    from jaxrunner.llm import LLM  # lazy: the CLI loads JAX only for commands that run a model

    llm = LLM(model, **options)
    report = llm.startup_report
    print(llm.engine.model.summary(), file=sys.stderr)
    print(f"start-up: {len(report['buckets'])} buckets warmed up in {report['warmup_s']:.1f} s, "
          f"KV pool {report['kv_pages']} pages ({report['kv_tokens']} tokens), attention {report['attention_impl']}",
          file=sys.stderr)
    return llm


def _sampling(args):
    return SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed,
                          top_p=getattr(args, "top_p", 1.0))


def cmd_generate(args) -> int:
    params = _sampling(args)  # validate flags before the model loads
    options = _narrowed_options(args, len(args.prompt))  # a one-shot job knows its batch
    _join_cluster(args)
    llm = _start(args.model, options)
    tokenizer = llm.get_tokenizer()
    use_chat = not args.raw and tokenizer is not None and getattr(tokenizer, "chat_template", None)
    prompts = [llm.chat_prompt([{"role": "user", "content": p}]) if use_chat else p for p in args.prompt]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(args.prompt, outputs):
        completion = output.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "text": completion.text, "token_ids": completion.token_ids,
                              "finish_reason": completion.finish_reason}))
        else:
            print(completion.text)
    return 0


def cmd_chat(args) -> int:
    params = _sampling(args)
    options = _narrowed_options(args, 1)  # one conversation: one sequence a step
    _join_cluster(args)
    llm = _start(args.model, options)
    if llm.get_tokenizer() is None or not getattr(llm.get_tokenizer(), "chat_template", None):
        raise ValueError(f"model {args.model!r} has no chat template; use `jaxrunner generate --raw`")
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    interactive = sys.stdin.isatty()
    print("jaxrunner chat — /reset clears the conversation, /exit quits", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            break
        if not line:  # end of input
            break
        line = line.strip()
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history.clear()
            print("(conversation cleared)", flush=True)
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        prompt = _fit_chat_prompt(llm, system, history, params.max_tokens)
        if prompt is None:
            history.pop()
            print(f"jaxrunner chat: error: the message alone exceeds --max-model-len {llm.engine.max_model_len} "
                  "tokens; not sent", file=sys.stderr, flush=True)
            continue
        reply = []
        try:
            for delta in llm.stream(prompt, params):
                reply.append(delta)
                print(delta, end="", flush=True)
        except KeyboardInterrupt:  # stop this reply, keep the session
            print(" [interrupted]", end="", flush=True)
        print(flush=True)
        history.append({"role": "assistant", "content": "".join(reply)})
    return 0


def _fit_chat_prompt(llm, system: list[dict], history: list[dict], max_tokens: int):
    """The templated prompt of the conversation, dropping the oldest exchanges (from ``history`` too) until
    it leaves room to answer within max_model_len; None, with ``history`` untouched, when even the last
    message alone does not fit."""
    limit = llm.engine.max_model_len
    kept = list(history)
    while kept:
        prompt = llm.chat_prompt(system + kept)
        if len(prompt["prompt_token_ids"]) + min(max_tokens, 16) <= limit:
            dropped = len(history) - len(kept)
            if dropped:
                history[:] = kept
                print(f"(dropped the {dropped} oldest message(s) to fit --max-model-len {limit})",
                      file=sys.stderr, flush=True)
            return prompt
        if len(kept) == 1:
            return None
        del kept[:2]  # the oldest user message and its reply
    return None


def _check_destination(dst: str, overwrite: bool) -> None:
    """Fail before the source is loaded: the destination must be creatable, and empty unless --overwrite."""
    path = os.path.abspath(os.path.expanduser(dst))
    if os.path.isfile(path):
        raise ValueError(f"destination {dst!r} is a file; valid: a new or empty directory (or an existing "
                         "checkpoint with --overwrite)")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"destination {dst!r} lies under {parent!r}, which is a file, not a directory")
    if os.path.isdir(path) and os.listdir(path):
        if not os.path.isfile(os.path.join(path, ORBAX_MARKER)):
            raise ValueError(f"destination {dst!r} is a non-empty directory that holds no jaxrunner checkpoint; "
                             "valid: a new or empty directory, or a checkpoint to replace with --overwrite")
        if not overwrite:
            raise ValueError(f"destination {dst!r} holds a jaxrunner checkpoint; pass --overwrite to replace it")


def cmd_convert(args) -> int:
    # lazy: loading and saving a model pull in JAX and numpy, which --help and the other commands do without
    from jaxrunner.models.loading import load_model
    from jaxrunner.models.loading.orbax_ckpt import save_checkpoint

    _check_destination(args.dst, args.overwrite)
    start = time.perf_counter()
    model = load_model(args.src, args.dtype, progress=sys.stderr.isatty())
    source_s = time.perf_counter() - start
    save_checkpoint(args.dst, model.params, model.hf_config, model.tokenizer, overwrite=args.overwrite,
                    generation_config=model.generation_config)
    start = time.perf_counter()
    load_model(args.dst, args.dtype, progress=False)
    converted_s = time.perf_counter() - start
    print(f"wrote {args.dst}: load from {model.source.kind} {source_s:.2f} s, "
          f"from the converted checkpoint {converted_s:.2f} s ({source_s / max(converted_s, 1e-9):.1f}× faster)")
    return 0


def _cpu_features() -> str:
    """The CPU extensions the kernels are built and chosen for, and the cap when one is set."""
    features = ", ".join(kernels.cpu_features()) or "none of those the kernels use"
    cap = kernels.max_isa()
    return features if cap is None else f"{features} (capped: JAXRUNNER_CPU_MAX_ISA={cap})"


def _attention_tiles(platform: str) -> str:
    """Whether the native CPU attention runs bf16 prefill rows on AMX-BF16 tiles here."""
    if platform == "cpu" and kernels.attention_tiles_ready():
        return "bf16 prefill rows on AMX-BF16 tiles"
    return "no (needs the native CPU kernel, AMX-BF16 and the OS's grant of AMX)"


def cmd_info(args) -> int:
    import jax  # lazy: the CLI loads JAX only for commands that ask it about devices or run a model

    device = jax.devices()[0]
    try:
        default_model = resolve_model(DEFAULT_MODEL).path
    except ModelNotFoundError as err:
        default_model = f"not available ({err})"
    info = {"jaxrunner": __version__, "jax": jax.__version__, "python": platform.python_version(),
            "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
            "cpu_count": os.cpu_count(), "cpu_features": _cpu_features(),
            "attention_impl": kernels.resolve_impl("auto", device.platform),
            "native_cpu_kernel": kernels.capabilities(device.platform).native_cpu_status,
            "native_attention_tiles": _attention_tiles(device.platform),
            "cpu_matmul": kernels.choose_matmuls("auto", device.platform)[1],
            "default_model": f"{DEFAULT_MODEL}: {default_model}",
            "compilation_cache_dir": EngineConfig().compilation_cache_dir}
    if args.json:
        print(json.dumps(info))
        return 0
    for name, value in info.items():
        print(f"{name}: {value}")
    return 0


def cmd_serve(args) -> int:
    # lazy: FastAPI and uvicorn load only for `serve`
    from jaxrunner.entrypoints.openai.api_server import LoRAModulePath, ServerConfig
    from jaxrunner.entrypoints.openai.server_process import run_server

    model = args.model_tag or args.model
    options = {**_engine_options(args), **_lora_options(args)}
    EngineConfig(model=model, **options)  # every engine option is checked before the model loads
    resolve_model(model)  # and the model exists
    if args.max_queue < 0:
        raise ValueError(f"--max-queue: {args.max_queue} must be >= 0")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port: {args.port} must be in 1..65535")
    if not args.shutdown_timeout > 0:
        raise ValueError(f"--shutdown-timeout: {args.shutdown_timeout} must be > 0 seconds")
    _join_cluster(args)
    for flag in ("allowed_origins", "allowed_methods", "allowed_headers"):
        value = getattr(args, flag)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"--{flag.replace('_', '-')}: a JSON list of strings, got {value!r}")
    if args.generation_config not in ("auto", "vllm") and not os.path.isdir(args.generation_config):
        raise ValueError(f"--generation-config: 'auto', 'vllm' or a directory, got {args.generation_config!r}")
    config = ServerConfig(model=model, served_model_name=args.served_model_name, host=args.host, port=args.port,
                          api_key=args.api_key or os.environ.get("JAXRUNNER_API_KEY"), max_queue=args.max_queue,
                          shutdown_timeout_s=args.shutdown_timeout, generation_config=args.generation_config,
                          allowed_origins=tuple(args.allowed_origins), allowed_methods=tuple(args.allowed_methods),
                          allowed_headers=tuple(args.allowed_headers), allow_credentials=args.allow_credentials,
                          uvicorn_log_level=args.uvicorn_log_level, log_requests=args.enable_log_requests,
                          chat_template=_chat_template(args.chat_template),
                          enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                          lora_modules=tuple(LoRAModulePath(*item) for item in args.lora_modules or ()))
    return run_server(config, options)


def _chat_template(value: str | None) -> str | None:
    """--chat-template: a file holding a Jinja template, or the template itself (as vLLM reads it)."""
    if value is None or not os.path.isfile(value):
        return value
    with open(value, encoding="utf-8") as f:
        return f.read()


def cmd_bench(args) -> int:
    scripts = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
    script = os.path.join(scripts, "soak.py" if args.kind == "soak" else f"benchmark_{args.kind}.py")
    if not os.path.isfile(script):
        raise FileNotFoundError(f"{script}: benchmark scripts ship with the source tree (scripts/)")
    sys.argv = [script, *args.rest]
    runpy.run_path(script, run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxrunner", description="JAX/XLA LLM inference runtime")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompt", nargs="+", help="prompt text (several prompts are batched)")
    gen.add_argument("--max-tokens", type=int, default=64, help="most new tokens per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt (text, token_ids)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _add_engine_flags(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat on stdin (streams replies; /reset, /exit)")
    chat.add_argument("--max-tokens", type=int, default=256, help="most new tokens per reply")
    chat.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    chat.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    chat.add_argument("--seed", type=int, default=0, help="sampling seed")
    chat.add_argument("--system", default=None, help="system prompt (default: the chat template's own, if any)")
    _add_engine_flags(chat)
    chat.set_defaults(func=cmd_chat)

    conv = sub.add_parser("convert", help="write a model as a jaxrunner (orbax) checkpoint; loads faster")
    conv.add_argument("src", help="alias, .gguf file or HF directory")
    conv.add_argument("dst", help="output directory")
    conv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="stored dtype")
    conv.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint at DST")
    conv.set_defaults(func=cmd_convert)

    info = sub.add_parser("info", help="devices, backend, CPU features, attention impl, versions, default model, "
                                       "cache dir")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.set_defaults(func=cmd_info)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="the model (same as --model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 "
                       "(default: $JAXRUNNER_API_KEY, else no key)")
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="the model names clients may send (default: MODEL); the first is reported")
    serve.add_argument("--generation-config", default="auto", help="sampling defaults: 'auto' (the model's "
                       "generation_config.json), 'vllm' (none) or a directory holding one")
    serve.add_argument("--allowed-origins", type=json.loads, default=["*"], help='CORS origins, JSON (default ["*"])')
    serve.add_argument("--allowed-methods", type=json.loads, default=["*"], help='CORS methods, JSON (default ["*"])')
    serve.add_argument("--allowed-headers", type=json.loads, default=["*"], help='CORS headers, JSON (default ["*"])')
    serve.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    serve.add_argument("--uvicorn-log-level", default="warning",
                       choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's log level")
    serve.add_argument("--enable-log-requests", action="store_true",
                       help="log each request (id, prompt lengths, sampling params) to stderr")
    serve.add_argument("--chat-template", default=None,
                       help="a Jinja chat template (a file, or the template text) for requests that give none")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='serve tool_choice "auto": calls are read from the output by --tool-call-parser')
    serve.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral", "qwen3_xml"],
                       help="the format the model writes tool calls in")
    serve.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters: a request's model names "
                       "one (--lora-modules, or POST /v1/load_lora_adapter)")
    serve.add_argument("--max-loras", type=int, default=None, help="adapters on the device at once (default 1)")
    serve.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank (default 16)")
    serve.add_argument("--max-cpu-loras", type=int, default=None,
                       help="adapters kept in host memory (default: --max-loras)")
    serve.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None, metavar="NAME=PATH",
                       help='adapters served from the start, each name=path or JSON {"name": ..., "path": ...}')
    serve.add_argument("--max-queue", type=int, default=4096, help="waiting requests beyond this get 503")
    serve.add_argument("--shutdown-timeout", type=float, default=10.0, help="seconds in-flight requests get "
                       "after SIGINT/SIGTERM; those still running then end with an error event")
    serve.add_argument("--seed", type=int, default=0, help="engine seed for requests without one")
    _add_engine_flags(serve)
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="run a benchmark script (throughput, latency, serving, startup) or "
                           "the soak run")
    bench.add_argument("kind", choices=["throughput", "latency", "serving", "startup", "soak"])
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="flags passed to the script")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv=None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # transformers advises at import that torch is missing; jaxrunner uses only its tokenizers
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"jaxrunner {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
