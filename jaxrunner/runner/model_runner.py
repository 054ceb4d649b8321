"""The functional model step and the object that holds its device state between steps.

``model_step(params, kv_cache, batch, feed) -> (sampled, feed, kv_cache)`` (``batch`` a
``step_batch.StepBatch``) is pure and jitted once per bucket shape with the cache donated, so XLA
updates the page pool in place. ``feed`` carries the sampled token ids from one step to the next
on the device (async scheduling: the host plans step N+1 while step N runs, so step N's tokens
are not known when N+1 is packed). ``ModelRunner`` only keeps the current params/cache/feed
references and turns step batches of numpy arrays into one device call and one device→host copy
per step.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import inspect
import os
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner import kernels
from jaxrunner.models import lora, packed_weights, registry
from jaxrunner.models.attention import PagedAttention
from jaxrunner.models.config import ModelConfig
from jaxrunner.models.params import param_shapes
from jaxrunner.parallel import mesh as meshes, sharding
from jaxrunner.runner import cache_events, sampler
from jaxrunner.runner.step_batch import StepBatch


def model_step(params, kv_cache, batch: StepBatch, feed, *, architecture, attention, max_loras: int = 0,
               native_sampling: bool = False):
    """Forward the packed tokens, take each sequence's last row, sample one token per sequence.

    ``architecture`` is the model's ``forward`` and ``compute_logits`` over ``params`` (a family
    of ``models.registry``, or a user's Flax NNX module). Token slots with ``feed_rows >= 0`` take
    their id from ``feed`` (the previous step's sampled tokens); the returned feed holds this
    step's, padded to the same fixed length.

    Prompt logprobs: rows whose ``prompt_targets`` name a token (the next prompt token) get its
    logprob, rank and the top logprobs. Only a batch with such a row computes every row's final
    hidden state and the vocabulary projection over them (``lax.cond``); others get zeros.

    Speculative decoding: a batch with ``draft_rows`` also samples those rows (after the
    sequences' own rows), each verifying one proposed token (``sampler.with_draft_rows``).

    ``native_sampling``: the sampler's top-k/top-p thresholds and the logprob statistics (of sampled
    and prompt tokens) in the native CPU kernels (the runner's choice where the element-wise native
    kernels run).

    LoRA: ``params`` carry ``max_loras`` adapter slots (``models.lora.attach``) and each token row
    names its slot in ``batch.lora_slots``.
    """
    if max_loras:
        params = lora.bind(params, batch.lora_slots, max_loras, params["final_norm"].dtype,
                           architecture.cfg.num_kv_heads)
    fed = jnp.take(feed, jnp.maximum(batch.feed_rows, 0), axis=0)
    token_ids = jnp.where(batch.feed_rows >= 0, fed, batch.token_ids)
    targets = batch.prompt_targets
    wants_prompt_logprobs = jnp.any(targets >= 0)
    rows, sampling = batch.logits_indices, batch.sampling
    if batch.draft_rows is not None:
        rows = jnp.concatenate([rows, batch.draft_rows.logits_indices])
        sampling = sampler.with_draft_rows(sampling, batch.draft_rows)
    hidden, kv_cache, every_row = _forward(architecture, params, token_ids, batch.positions, kv_cache,
                                           batch.attention, attention, rows, wants_prompt_logprobs)
    logits = architecture.compute_logits(params, hidden)
    sampled = sampler.sample(logits, sampling, native_sampling=native_sampling)
    logits_of = functools.partial(architecture.compute_logits, params)
    sampled.update(jax.lax.cond(wants_prompt_logprobs,
                                lambda h: sampler.prompt_logprobs(logits_of, h, targets,
                                                                  native_sampling=native_sampling),
                                lambda h: sampler.empty_prompt_logprobs(h.shape[0]), every_row))
    seq_tokens = sampled["tokens"][:batch.logits_indices.shape[0]]
    next_feed = jax.lax.dynamic_update_slice(jnp.zeros_like(feed), seq_tokens.astype(feed.dtype), (0,))
    return sampled, next_feed, kv_cache


def _forward(architecture, params, token_ids, positions, kv_cache, meta, attention, rows, all_rows):
    """(final hidden of ``rows``, new cache, final hidden of every row); ``meta`` is the step's
    ``AttentionMetadata``, which the architecture hands to ``attention``. An architecture whose
    ``forward`` takes ``all_rows`` runs its last layer on every row only in steps that need it
    (prompt logprobs); any other runs it on every row and the sampled rows are taken after."""
    if "all_rows" in inspect.signature(architecture.forward).parameters:
        return architecture.forward(params, token_ids, positions, kv_cache, meta, attention, rows=rows,
                                    all_rows=all_rows)
    every_row, kv_cache = architecture.forward(params, token_ids, positions, kv_cache, meta, attention)
    return jnp.take(every_row, rows, axis=0), kv_cache, every_row


# Jitted steps in use, by argument set. Weak values: JAX keeps every executable a jitted function has
# compiled on that function (its trace, lowering and executable caches), so the function must die
# with the last runner that uses it, or each engine built and dropped in a process would leave its
# executables (and their code mappings) behind for good.
_SHARED_STEPS: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def flat_params_step(param_leaves, kv_cache, batch, feed, *, param_tree, **options):
    """``model_step`` over params passed as their leaves in ``param_tree``'s order.

    A jitted call flattens its arguments on every call, and the params are hundreds of leaves in
    nested dicts whose keys it sorts each time: passed as one flat tuple they cost the host a
    fraction of that per step, and the tree is rebuilt at trace time, for free."""
    return model_step(jax.tree.unflatten(param_tree, param_leaves), kv_cache, batch, feed, **options)


def jitted_step(architecture, attention, param_tree, shardings=None, max_loras: int = 0,
                native_sampling: bool = False):
    """``flat_params_step`` jitted with the cache donated (and, on a mesh, the declared ``(param
    leaves, cache, replicated)`` shardings), one per distinct argument set, shared by the runners
    alive in the process.

    JAX caches traces, lowerings and executables on the jitted function, so a second engine whose
    options do not change any shape (seed, prefix caching, async scheduling, sampling defaults)
    reuses them all and compiles nothing while the first is alive; once every runner holding the
    function is gone, so are its executables. Arguments that cannot be hashed (a user's
    architecture object) get a function of their own."""
    key = (architecture, attention, param_tree, max_loras, native_sampling,
           None if shardings is None else jax.tree.flatten(shardings, is_leaf=lambda x: x is None))
    try:
        hash(key)
    except TypeError:
        return _jit_step(architecture, attention, param_tree, shardings, max_loras, native_sampling)
    step = _SHARED_STEPS.get(key)
    if step is None:
        step = _jit_step(architecture, attention, param_tree, shardings, max_loras, native_sampling)
        _SHARED_STEPS[key] = step
    return step


def _jit_step(architecture, attention, param_tree, shardings, max_loras: int, native_sampling: bool):
    step = functools.partial(flat_params_step, param_tree=param_tree, architecture=architecture,
                             attention=attention, max_loras=max_loras, native_sampling=native_sampling)
    if shardings is None:
        return jax.jit(step, donate_argnums=(1,))
    params, cache, replicated = shardings
    return jax.jit(step, in_shardings=(params, cache, replicated, replicated),
                   out_shardings=(replicated, replicated, cache), donate_argnums=(1,))


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    num_pages: int
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def bytes_per_page(self) -> int:
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * jnp.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.bytes_per_page

    def pool_shapes(self, attention_impl: str) -> tuple[tuple[int, ...], ...]:
        """The pools of one layer in the layout ``attention_impl`` reads (``kernels.kv_pool_shapes``):
        ``(k_pages, v_pages)``, or for ``jax_tpu`` the one K/V-interleaved pool jax's kernel reads,
        so that no step copies pages into it. Either holds ``nbytes / num_layers``."""
        return kernels.kv_pool_shapes(attention_impl, self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    def allocate(self, sharding=None, attention_impl: str = "xla"):
        """One tuple of zero-filled pools per layer (:meth:`pool_shapes`; every implementation but
        ``jax_tpu`` keeps two), placed by ``sharding`` (or a device)."""
        makes = [_zeros_function(shape, jnp.dtype(self.dtype), sharding) for shape in self.pool_shapes(attention_impl)]
        return [tuple(make() for make in makes) for _ in range(self.num_layers)]


@functools.lru_cache(maxsize=8)
def _zeros_function(shape, dtype, sharding):
    """One jitted zero-fill per pool shape and placement, shared by every pool of the process (a
    second engine with the same pool compiles nothing)."""
    return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)


class ModelRunner:
    """Owns params and the KV cache on one mesh; runs packed batches through per-bucket executables.

    The mesh is ``("data", "model")`` with one data row: a single device, or ``tp`` devices that
    split heads, MLP and vocabulary (``jaxrunner.parallel.sharding``). On several devices every
    executable declares the shardings of params, cache and batch, so nothing is re-laid out
    between steps; on one device the arrays are simply committed to it.

    Executables are compiled ahead of time (``compile``), one per bucket, during warm-up; ``execute``
    only dispatches to them. A bucket that was not compiled is an error, never a silent compile in
    the serving loop.
    """

    def __init__(self, cfg: ModelConfig, params, cache_spec: KVCacheSpec, attention_impl: str,
                 mesh=None, max_prefill_seqs: int | None = None, max_seqs_per_step: int = 512, architecture=None,
                 matmuls: kernels.MatmulKernels | None = None, lora_spec: lora.LoraSpec | None = None):
        """``attention_impl``: one of ``kernels.ATTENTION_IMPLS``, chosen at start-up
        (``startup.choose_attention``); ``max_seqs_per_step``: the widest bucket's sequences (the
        length of the token feed);
        ``architecture``: the model functions (default: ``cfg``'s registered family, its linear
        products where ``matmuls`` says: chosen at start-up by ``kernels.choose_matmuls``, by
        default ``kernels.capabilities``' choice for this platform); ``lora_spec``: adapter slots
        beside the params (``models.lora``), all zero until :meth:`write_lora_slot`."""
        self.cfg = cfg
        self.cache_spec = cache_spec
        self.mesh = mesh if mesh is not None else meshes.build_mesh(1, 1)
        self.device = meshes.local_device(self.mesh)
        if attention_impl not in kernels.ATTENTION_IMPLS:
            raise ValueError(f"attention_impl={attention_impl!r}: the runner takes a chosen implementation, one of "
                             f"{kernels.ATTENTION_IMPLS} (startup.choose_attention resolves 'auto')")
        self.attention_impl = attention_impl
        if matmuls is None:
            matmuls = kernels.capabilities(self.device.platform).matmuls
        self.matmuls = matmuls  # where the model's products run
        sharded = meshes.tensor_parallel_size(self.mesh) > 1
        # queries keep the model's dtype over 8-bit float pages (the kernels widen those as they read)
        query_dtype = params["final_norm"].dtype if kernels.is_fp8(cache_spec.dtype) else None
        attention = PagedAttention(self.attention_impl, self.mesh if sharded else None, max_prefill_seqs,
                                   query_dtype)
        param_shardings = sharding.param_shardings(params, self.mesh, registry.partition_rules(cfg))
        self.lora_spec, self.lora_slots, slot_shardings = lora_spec, None, None
        if lora_spec is not None:
            self.lora_slots, slot_shardings = self._placed_slots(params)
            self._write_slot = jax.jit(lora.write, out_shardings=slot_shardings)
        pool = sharding.kv_pool_sharding(self.mesh)
        cache_shardings = [(pool,) * len(cache_spec.pool_shapes(attention_impl))] * cache_spec.num_layers
        self.batch_sharding = sharding.replicated(self.mesh)
        own_architecture = architecture is None
        architecture = architecture if architecture is not None else registry.architecture_for(cfg, self.matmuls)
        max_loras = 0 if lora_spec is None else lora_spec.max_loras
        # the family's linear weights, packed for oneDNN where `matmuls` says (a family's own
        # architecture reads its params its own way: nothing is packed for it)
        self._packed_leaves = registry.family_for_config(cfg).quantized_leaves if own_architecture else ()
        self._param_tree = None  # the step's params tree: set by the first params
        self.params = self._for_step(jax.device_put(params, param_shardings))  # put: a no-op when in place
        if self.mesh.size == 1:  # committed single-device arrays; declared shardings only cost compile time
            # the sampler's thresholds and logprob statistics in the native kernels where the
            # element-wise steps are
            self._jitted_step = jitted_step(architecture, attention, self._param_tree, max_loras=max_loras,
                                            native_sampling=self.matmuls.elementwise == "native")
        else:
            step_shardings = param_shardings if lora_spec is None else lora.attach(param_shardings, slot_shardings)
            leaf_shardings = tuple(self._param_tree.flatten_up_to(step_shardings))
            self._jitted_step = jitted_step(architecture, attention, self._param_tree,
                                            (leaf_shardings, cache_shardings, self.batch_sharding), max_loras)
        self._executables: dict = {}
        self.kv_cache = cache_spec.allocate(pool, attention_impl)
        self.feed = jax.device_put(np.zeros(max_seqs_per_step, np.int32), self.batch_sharding)

    def _for_step(self, params):
        """``params`` as the step reads them: the linear weights packed for oneDNN where chosen."""
        if not self._packed_leaves:
            return params
        return packed_weights.pack(params, self._packed_leaves, self.matmuls)

    def plain_params(self):
        """The params as the model holds them (``models.packed_weights.unpack``: new arrays where
        the step reads packed weights)."""
        return packed_weights.unpack(self.params)

    def plain_params_like(self):
        """Shapes, dtypes and shardings of :meth:`plain_params`, without unpacking."""
        return packed_weights.plain_like(self.params)

    def replace_params(self, params) -> None:
        """Serve ``params`` (placed like :meth:`plain_params_like`) from the next step on."""
        self.params = self._for_step(params)

    def _placed_slots(self, params) -> tuple[list, list]:
        """Zero adapter slots on the mesh, split as their projections are, and their shardings."""
        slots = self.lora_spec.empty_slots(self.cfg, param_shapes(self.cfg)["layers"], params["final_norm"].dtype)
        attached = sharding.param_shardings(lora.attach(params, slots), self.mesh, registry.partition_rules(self.cfg))
        slot_shardings = [layer[lora.SLOTS_KEY] for layer in attached["layers"]]
        return jax.device_put(slots, slot_shardings), slot_shardings

    def trace(self, batch):
        """The step traced to a jaxpr for ``batch``'s shapes (Python runs the model once)."""
        return self._jitted_step.trace(self.step_params, self.kv_cache, batch, self.feed)

    def lower(self, batch):
        return self.trace(batch).lower()

    def compile_all(self, batches: dict, workers: int | None = None) -> dict:
        """Compile one executable per bucket (``{bucket: example batch}``); returns per-bucket info.

        Tracing and lowering hold the GIL, XLA's compilation does not: each bucket is traced and
        lowered in turn on this thread and handed to a compile thread as soon as it is lowered, so
        compiling one bucket overlaps lowering the next.
        """
        workers = workers or os.cpu_count() or 1
        with cache_events.watch() as watch, concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {bucket: pool.submit(self._compile_lowered, bucket, *self._trace_and_lower(batch), watch)
                       for bucket, batch in batches.items()}
            return {bucket: future.result() for bucket, future in futures.items()}

    def compile(self, bucket, batch) -> dict:
        """Compile the executable for ``bucket``; returns seconds and XLA's memory analysis."""
        with cache_events.watch() as watch:
            return self._compile_lowered(bucket, *self._trace_and_lower(batch), watch)

    def _trace_and_lower(self, batch):
        start = time.perf_counter()
        traced = self.trace(batch)
        traced_at = time.perf_counter()
        lowered = traced.lower()
        return lowered, {"trace_s": traced_at - start, "lower_s": time.perf_counter() - traced_at}

    def _compile_lowered(self, bucket, lowered, info: dict, watch) -> dict:
        start = time.perf_counter()
        before = watch.this_thread()
        compiled = lowered.compile()
        self._executables[bucket] = compiled
        info = {**info, "compile_s": time.perf_counter() - start,
                "persistent_cache": cache_events.outcome(before, watch.this_thread())}
        analysis = compiled.memory_analysis()
        if analysis is not None:
            info.update(temp_bytes=int(analysis.temp_size_in_bytes),
                        argument_bytes=int(analysis.argument_size_in_bytes),
                        output_bytes=int(analysis.output_size_in_bytes))
        return info

    @property
    def compiled_buckets(self) -> list:
        return sorted(self._executables)

    def execute(self, bucket, batch) -> dict[str, np.ndarray]:
        """Run one step on a packed numpy batch; the only device→host copy is the sampled output."""
        return self.fetch(self.dispatch(bucket, batch))

    def dispatch(self, bucket, batch):
        """Start one step (asynchronously) and return its device outputs; see ``fetch``.

        The step reads the token feed of the step dispatched before it (its ``feed_rows``)."""
        executable = self._executables.get(bucket)
        if executable is None:
            raise RuntimeError(f"bucket {bucket} was not compiled at warm-up")
        if jax.process_count() > 1:  # every process passes the same batch as one global array
            batch = jax.device_put(batch, self.batch_sharding)
        sampled, self.feed, self.kv_cache = executable(self.step_params, self.kv_cache, batch, self.feed)
        return sampled

    @property
    def params(self):
        return self._params

    @params.setter
    def params(self, params) -> None:
        self._set_step_params(params, self.lora_slots)

    def _set_step_params(self, params, lora_slots) -> None:
        """Hold ``params`` and ``lora_slots`` and the leaves the step reads (:attr:`step_params`);
        a tree other than the one the step was built for is refused and changes nothing."""
        leaves, tree = jax.tree.flatten(params if lora_slots is None else lora.attach(params, lora_slots))
        if self._param_tree is not None and tree != self._param_tree:
            raise ValueError(f"params: the step was built for the tree {self._param_tree}, got {tree}")
        self._params, self.lora_slots, self._param_tree, self._step_leaves = params, lora_slots, tree, tuple(leaves)

    @property
    def step_params(self) -> tuple:
        """The leaves of the params, with the adapter slots attached when there are some, as the
        jitted step takes them (``flat_params_step``): flattened once per change, not per step."""
        return self._step_leaves

    def write_lora_slot(self, slot: int, adapter_layers: list) -> None:
        """Put an adapter (``models.loading.peft.Adapter.layers``) into ``slot`` (1-based); the
        steps dispatched from now on read it, one in flight keeps the slots it was given."""
        self._set_step_params(self._params, self._write_slot(self.lora_slots, np.int32(slot), adapter_layers))

    @staticmethod
    def fetch(sampled, prompt_logprobs: bool = True) -> dict[str, np.ndarray]:
        """Device outputs of ``dispatch`` -> numpy. They are replicated, so every process reads its
        own copy (under ``jax.distributed`` the mesh spans devices this process cannot address).

        ``prompt_logprobs=False`` leaves the per-token prompt outputs on the device (a step whose
        batch asked for none: they are zeros)."""
        if not prompt_logprobs:
            sampled = {name: x for name, x in sampled.items() if not name.startswith("prompt_")}
        if all(x.is_fully_addressable for x in sampled.values()):
            return jax.device_get(sampled)
        return {name: np.asarray(x.addressable_data(0)) for name, x in sampled.items()}
