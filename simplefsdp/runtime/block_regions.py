"""Compile a repeated block once: each block gathers its parameters, then runs its compute in a
``torch.compiler.nested_compile_region`` shared by the blocks of its structure (``functional_call`` of a data-less
copy). Why each piece is there, and what it costs: ``ARCHITECTURE.md``, "Compiling a repeated block once".
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import itertools
import textwrap
from typing import Callable

import torch
from torch import nn
from torch.func import functional_call
from torch.fx.experimental.symbolic_shapes import has_static_value
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map_only, tree_unflatten
from torch.utils.checkpoint import checkpoint

from simplefsdp.runtime.replicate_compute import ReplicateComputation


def install_block_regions(model: nn.Module, blocks: tuple[str, ...], replicate: ReplicateComputation,
                          gathers_in_region: bool, strict: bool, keyed: frozenset[str] = frozenset()
                          ) -> Callable[[], None]:
    """Run each of ``model``'s ``blocks`` (FQNs, sharded by ``shard_parameters``, not tensor-parallel) as gathers (in a
    region of their own with ``gathers_in_region``, which the backend inlines), then one region per distinct block
    (unless ``strict``, blocks that differ only in settings' values, but those in ``keyed``, share one). A call no
    region can run raises if ``strict``, else runs the block's own forward. Returns a function that undoes this."""
    regions: dict[tuple, dict[bool, Callable]] = {}
    replaced: dict[nn.Module, Callable | None] = {}  # each block's forward of its own, if any

    def gather(*params):
        # A region may not return a view of its input, as a gather without an all-gather is (one rank, a replicated
        # parameter): it returns clones, which the backend drops as it inlines the region.
        return [tensor.clone() for tensor in replicate.gather_shards(*params)]

    computations = {fqn: replicate.in_block(fqn, blocks) for fqn in blocks}  # the last block keeps its gathers
    regathered = [fqn for fqn in blocks if computations[fqn] is replicate]
    # The region holds the gathers recomputed in backward. Dynamo inlines a region called once, clones included, and
    # the partitioner would keep those clones: a single such block gathers inline, as the block that keeps its own.
    gather_region = torch.compiler.nested_compile_region(gather) if gathers_in_region and len(regathered) > 1 else None
    signatures, reads_of = {}, {}
    for fqn in blocks:
        block = model.get_submodule(fqn)
        reads_of[fqn] = [(prefix, module, name) for prefix, module in block.named_modules(remove_duplicate=False)
                         for name in vars(module).get("_gather_keys", {})]
        buffers = list(block.named_buffers())
        tensors = [module._parameters[name] for _, module, name in reads_of[fqn]] + [tensor for _, tensor in buffers]
        signatures[fqn] = ((_structure(block) if strict else _settings_named(_structure(block), keyed)),
                           (*(f"{prefix}.{name}".lstrip(".") for prefix, _, name in reads_of[fqn]),
                            *(name for name, _ in buffers)),
                           tuple((tensor.shape, tensor.stride(), tensor.dtype) for tensor in tensors),
                           # a checkpointed block's forward: checkpoint's keyword arguments
                           None if (forward := vars(block).get("forward")) is None
                           else tuple(sorted(forward.keywords.items())))
    for fqn in blocks:
        block, reads, signature = model.get_submodule(fqn), reads_of[fqn], signatures[fqn]
        buffers, names = list(block.named_buffers()), list(signature[1])
        if signature not in regions:
            alike = [model.get_submodule(other) for other in blocks if signatures[other] == signature]
            statistics = _running_statistics(block)
            regions[signature] = {training: _region(_template(block, _differing_settings(alike)).train(training),
                                                    names, signature[3],
                                                    tuple(index for index, name in enumerate(names)
                                                          if training and name in statistics),
                                                    f"{len(regions)}_{'train' if training else 'eval'}")
                                  for training in (True, False)}
        replaced[block] = vars(block).get("forward")
        block.forward = functools.partial(_run_block, fqn, tuple(block.modules()), [read[1:] for read in reads],
                                          [buffer for _, buffer in buffers], computations[fqn],
                                          gather_region if computations[fqn] is replicate else None,
                                          regions[signature], None if strict else block.forward)

    def uninstall() -> None:
        for block, forward in replaced.items():
            del block.forward
            if forward is not None:
                block.forward = forward

    return uninstall


def distinct_blocks(model: nn.Module, blocks: tuple[str, ...], keyed: frozenset[str] = frozenset()) -> int:
    """How many of ``model``'s ``blocks`` differ in structure (modules' classes, the names of their settings, the
    values of those in ``keyed``) or in their tensors' names, shapes and dtypes: by default, each is traced as a region
    of its own."""
    return len({(_settings_named(_structure(block), keyed),
                 tuple((name, tensor.shape, tensor.dtype) for name, tensor in
                       itertools.chain(block.named_parameters(), block.named_buffers())))
                for block in map(model.get_submodule, blocks)})


def _settings_named(structure: tuple, keyed: frozenset[str]) -> tuple:
    """``_structure``'s tuple with each setting's name alone, not its value, but for the settings in ``keyed`` and
    those of torch.nn's own modules, whose forwards read them (a convolution's ``stride``, a dropout's ``p``)."""
    return tuple((prefix, cls, tuple((key, value) if key in keyed or cls.__module__.startswith("torch.nn.") else key
                                     for key, value in settings))
                 for prefix, cls, settings in structure)


def settings_read(model: nn.Module, blocks: tuple[str, ...]) -> frozenset[str]:
    """The settings to key regions by from the start: those that differ between blocks otherwise alike, that a method
    of their module's class reads (``self.sliding_window``), and that leave each region two blocks on average (not
    ``layer_idx``). A setting read otherwise is found as Dynamo traces the region: one failed attempt first."""
    alike: dict[tuple, list[nn.Module]] = {}
    for block in map(model.get_submodule, blocks):
        alike.setdefault(_settings_named(_structure(block), frozenset()), []).append(block)
    read = {key for group in alike.values() for prefix, keys in _differing_settings(group).items() for key in keys
            if key in _attributes_read(type(group[0].get_submodule(prefix)))}
    keyed = frozenset()
    for key in sorted(read):
        if two_blocks_a_region(model, blocks, keyed | {key}):
            keyed |= {key}
    return keyed


def two_blocks_a_region(model: nn.Module, blocks: tuple[str, ...], keyed: frozenset[str]) -> bool:
    """Whether regions keyed by ``keyed`` as well serve two of ``blocks`` each on average: compiling them costs
    less than the whole graph (a setting of one value a block, as ``layer_idx``, never passes)."""
    return 2 * distinct_blocks(model, blocks, keyed) <= len(blocks)


@functools.cache
def _attributes_read(cls: type) -> frozenset[str]:
    """``self``'s attributes that the methods (``__init__`` aside) of ``cls`` and its bases outside torch read."""
    names = set()
    for base in (base for base in cls.__mro__ if base.__module__.partition(".")[0] not in ("torch", "builtins")):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
        except (OSError, TypeError, SyntaxError):  # no source: defined in C, in a notebook, or made at run time
            continue
        for method in ast.walk(tree):
            if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) and method.name != "__init__":
                names.update(node.attr for node in ast.walk(method) if isinstance(node, ast.Attribute)
                             and isinstance(node.ctx, ast.Load) and getattr(node.value, "id", None) == "self")
    return frozenset(names)


def _differing_settings(blocks: list[nn.Module]) -> dict[str, set[str]]:
    """The settings whose values differ between ``blocks`` (of one structure but for those values), by prefix."""
    differing: dict[str, set[str]] = {}
    for modules in zip(*(_structure(block) for block in blocks)):
        for key, value in modules[0][2]:
            if any(dict(settings)[key] != value for _, _, settings in modules[1:]):
                differing.setdefault(modules[0][0], set()).add(key)
    return differing


def _structure(block: nn.Module) -> tuple:
    """What decides a block's compute besides its tensors and its mode: each module's class and plain settings
    (``layer_idx``, ``is_sliding``, ``eps``), so blocks that differ in any of them get regions of their own."""
    return tuple((prefix, vars(module).get("_class_without_getters", type(module)),
                  tuple(sorted((key, value) for key, value in vars(module).items()
                               if not key.startswith("_") and key != "training" and _is_setting(value))))
                 for prefix, module in block.named_modules(remove_duplicate=False))


_PLAIN = (type(None), bool, int, float, str)
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _is_setting(value) -> bool:
    return all(map(_is_setting, value)) if isinstance(value, tuple) else isinstance(value, (*_PLAIN, torch.dtype))


def _template(block: nn.Module, unreadable: dict[str, set[str]]) -> nn.Module:
    """A copy of ``block`` that holds no data: its modules' own classes (no gathering getters), no sharding state,
    forwards unwrapped; ``functional_call`` gives it every parameter and buffer. The settings of ``unreadable`` (by
    module prefix: those that differ between the blocks sharing the template) raise when the compute reads them,
    also through ``hasattr`` and ``getattr`` with a default: the region then fails to compile."""
    state = [tensor for module in block.modules() for key in ("_grad_accumulators", "_error_feedback")
             for tensor in vars(module).get(key, {}).values()]
    memo = {id(tensor): None for tensor in itertools.chain(block.parameters(), block.buffers(), state)}
    template = copy.deepcopy(block, memo)
    for module in template.modules():
        if "_class_without_getters" in vars(module):
            module.__class__ = module._class_without_getters
        for key in ("forward", "_gather_keys", "_grad_accumulators", "_error_feedback", "_class_without_getters"):
            vars(module).pop(key, None)
    for prefix, keys in unreadable.items():
        module = template.get_submodule(prefix)
        for key in keys:
            del vars(module)[key]
        module.__class__ = type(type(module).__name__, (type(module),), {key: _unreadable(key) for key in keys})
    return template


def _unreadable(key: str) -> property:
    def read(module: nn.Module) -> None:
        raise RuntimeError(f"compile_blocks_once ran blocks that differ in {key!r} as one region, and the compute "
                           f"reads {key!r}")

    return property(read)


READ_SETTING = r"compile_blocks_once ran blocks that differ in '(\w+)' as one region"  # ``_unreadable``'s error


def _running_statistics(block: nn.Module) -> set[str]:
    """The names of the buffers ``block``'s batch norms update in place in training (their running statistics)."""
    return {f"{prefix}.{name}".lstrip(".") for prefix, module in block.named_modules()
            if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats
            for name in ("running_mean", "running_var", "num_batches_tracked")}


def _region(template: nn.Module, names: list[str], checkpointing: tuple | None, updated: tuple[int, ...],
            name: str) -> Callable:
    """A call of the nested compile region that runs ``template`` on the tensors named ``names`` (the first positional
    arguments) and the block's own arguments, in ``checkpoint`` with ``checkpointing``'s options if not None, and
    returns the block's output (rebuilt from the structure recorded while tracing: ``ARCHITECTURE.md``). The
    arguments at ``updated`` (running statistics) are updated from copies the region updates and returns: a region
    may not update its input in place."""

    def run(*flat, **kwargs):
        return functional_call(template, dict(zip(names, flat)), flat[len(names):], kwargs, tie_weights=False)

    def compute(*flat, **kwargs):
        # each tensor through an alias first: torch 2.13's Dynamo records a tensor attribute read of a region's input
        # (Falcon's ``self.weight.T``, a block's ``x.mT``) in the outer graph, and then cannot reuse the region
        # (pytorch/pytorch#191785)
        flat, kwargs = tree_map_only(torch.Tensor, torch.ops.aten.alias, (flat, kwargs))
        copies = {index: flat[index].clone() for index in updated}
        flat = tuple(copies.get(index, tensor) for index, tensor in enumerate(flat))
        output = (run(*flat, **kwargs) if checkpointing is None
                  else checkpoint(run, *flat, **kwargs, **dict(checkpointing)))
        leaves, spec = tree_flatten(output)
        inputs = _tensors(flat, kwargs)
        # how the caller rebuilds each leaf: None where the region returns it, else ("constant", the value) or
        # ("input", its index): a region may not return its input (T5's blocks return the position bias they got)
        rebuilt = [("constant", leaf) if not isinstance(leaf, torch.Tensor)
                   else next((("input", index) for index, tensor in enumerate(inputs) if leaf is tensor), None)
                   for leaf in leaves]
        if not updated and all(how is None for how in rebuilt) and (isinstance(output, torch.Tensor) or (
                isinstance(output, (tuple, list)) and len(output) == len(leaves))):
            return output
        structures[reuse_key(*flat, **kwargs)] = spec, rebuilt
        return *(leaf for leaf, how in zip(leaves, rebuilt) if how is None), *copies.values()

    # Dynamo counts a region's traced variants (at most 8) per code, compared by value: a code of its own per region
    # (its name) lets a model hold more distinct blocks than that (Hugging Face's, each with its own layer_idx)
    compute.__code__ = compute.__code__.replace(co_name=f"compute_{name}")
    structures = OutputStructures()
    region_id = id(template)

    def reuse_key(*flat, **kwargs) -> int:
        """Equal for two calls of this region that can run the same traced code (a symbolic size counts as -1)."""
        return hash((region_id, *[tensor.requires_grad for tensor in flat[:len(names)]], _describe(flat[len(names):]),
                     _describe(kwargs)))

    region = torch.compiler.nested_compile_region(compute, reuse_hash_fn=reuse_key)

    def call(*flat, **kwargs):
        # a copy of each statistic in: the region's backward holds its inputs, and they are updated below
        output = region(*(tensor.clone() if index in updated else tensor for index, tensor in enumerate(flat)),
                        **kwargs)
        if (structure := structures.get(reuse_key(*flat, **kwargs))) is None:
            return output
        for index, statistic in zip(updated, output[len(output) - len(updated):]):
            flat[index].copy_(statistic)
        spec, rebuilt = structure
        tensors, inputs = iter(output[:len(output) - len(updated)]), _tensors(flat, kwargs)
        return tree_unflatten([next(tensors) if how is None else how[1] if how[0] == "constant" else inputs[how[1]]
                               for how in rebuilt], spec)

    return call


class OutputStructures(dict):
    """Per reuse key, a region output's pytree spec and how each leaf is rebuilt, written while Dynamo traces the
    region; only ever added to, the same for a key, so unguarded (``without_output_structure_guards``): a guard on it
    as it was before the first trace would compile the whole model again at the second call."""


def without_output_structure_guards(entries: list) -> list[bool]:
    """A ``guard_filter_fn`` for ``torch.compile``: every guard but those on an ``OutputStructures``."""
    return [not isinstance(entry.value, OutputStructures) for entry in entries]


def _tensors(flat: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a region is called with, in order."""
    return [leaf for leaf in tree_leaves((flat, kwargs)) if isinstance(leaf, torch.Tensor)]


def _describe(value) -> object:
    if isinstance(value, (tuple, list)):
        return type(value).__name__, *map(_describe, value)
    if isinstance(value, dict):
        return tuple((key, _describe(item)) for key, item in value.items())
    if isinstance(value, torch.Tensor):
        return (tuple(map(_static_or_minus_one, value.shape)), tuple(map(_static_or_minus_one, value.stride())),
                str(value.dtype), str(value.device), value.requires_grad)
    return _static_or_minus_one(value) if isinstance(value, (*_SYMBOLIC, int, float)) else value


def _static_or_minus_one(number: int | float | torch.SymInt | torch.SymFloat | torch.SymBool) -> object:
    """``number``, or -1 where it is symbolic. ``has_static_value``, not ``isinstance``: Dynamo reports a symbolic
    size's type as ``int``, and hashing it would specialize the size (every new sequence length compiled again)."""
    return number if has_static_value(number) else -1


def _run_block(fqn: str, modules: tuple[nn.Module, ...], reads: list[tuple[nn.Module, str]],
               buffers: list[torch.Tensor], replicate: ReplicateComputation,
               gather_region: Callable | None, regions: dict[bool, Callable],
               own_forward: Callable | None, *args, **kwargs):
    """Gather the block's parameters (``reads``, through ``gather_region`` if not None), then run the region of the
    mode of all its ``modules`` (a tuple: Dynamo traces ``block.modules()`` at a cost per block). A call no region can
    run goes to ``own_forward``, or raises where that is None."""
    modes = {module.training for module in modules}
    odd = next((leaf for leaf in tree_leaves((args, kwargs))
                if not isinstance(leaf, (torch.Tensor, *_PLAIN, *_SYMBOLIC))), None)
    # eagerly (a block called alone) a region gives nothing, and its template lacks the settings blocks differ in
    if own_forward is not None and (len(modes) > 1 or odd is not None or not torch.compiler.is_compiling()):
        return own_forward(*args, **kwargs)
    if len(modes) > 1:
        raise ValueError(f"compile_blocks_once runs a block in one mode; {fqn!r} has modules in training and in eval "
                         "mode: call .train() or .eval() on the whole block, or pass compile_blocks_once=False")
    if odd is not None:
        raise ValueError(f"compile_blocks_once passes a block only tensors and constants (None, bool, int, float, "
                         f"str); {fqn!r} got a {type(odd).__name__}: stop passing it (a Hugging Face model's "
                         "key-value cache: use_cache=False) or pass compile_blocks_once=False")
    return regions[modes.pop()](*replicate.gather_all(reads, gather_region), *buffers, *args, **kwargs)


def block_regions_refusal(model: nn.Module, blocks: tuple[str, ...]) -> str | None:
    """Why ``install_block_regions`` would not run ``blocks`` (a sentence naming the fix), or None: a block's forward
    replaced on the instance by anything but a checkpoint of its own (``apply_activation_checkpointing``'s)."""
    for fqn in blocks:
        block = model.get_submodule(fqn)
        forward = vars(block).get("forward")
        own = (isinstance(forward, functools.partial) and forward.func is checkpoint and len(forward.args) == 1
               and getattr(forward.args[0], "__self__", None) is block
               and getattr(forward.args[0], "__func__", None) is type(block).forward)
        if forward is not None and not own:
            return (f"compile_blocks_once runs a block's class forward; {fqn!r} has a forward of its own "
                    f"({forward!r}): make it a method of the class, checkpoint the block with "
                    "apply_activation_checkpointing, or pass compile_blocks_once=False")
    return None
