"""Hugging Face transformers' MoE load-balancing loss (`load_balancing_loss_func` of the MoE models' modeling files),
driven as a model's forward calls it and scaled as the Trainer scales the returned loss under gradient accumulation
and DDP.

What is read (STUBS): only `load_balancing_loss_func` of each modeling file. The file is parsed with `ast`; the
function's own source is executed in a namespace holding the module's top-level imports of torch, torch.nn,
torch.nn.functional (F), math and typing, run as written; no other transformers code runs, so no transformers
install is needed (Debian's torch 1.13 runs it). With LV_HF_IMPORT=1 the function objects are instead imported from
the installed transformers package (`transformers.models.M.modeling_M.load_balancing_loss_func`), the CHECKOUT then
being that package's folder: the same runs on the package as shipped. CHECKOUT is a folder holding
`src/transformers` (a clone, or an export laid out as the repository), `transformers`, or the package folder itself.

How a case maps onto the function (no math, LAYOUT): the rank's micro-batch becomes a padded batch, one batch row
per packed sequence of the micro-batch (in order, right-padded to the longest); each MoE layer's router logits are that
layer's columns put at their [batch x sequence] rows (zeros on the padding positions), the per-layer tensors handed as
a tuple in layer order (what `outputs.router_logits` holds); `attention_mask` [batch, sequence] is 1 on the case's
valid rows and 0 on padding and on the case's masked rows (the case's masked rows are not routed); `num_experts` E and
`top_k` k as the ForCausalLM passes `self.num_experts, self.num_experts_per_tok`. The model adds
`router_aux_loss_coef * aux_loss` (the case's aux_coef) to its loss.

The Trainer around it (trainer.py `compute_loss`, `training_step`, `_get_num_items_in_batch`; accelerate's
`Accelerator.backward`), for a model whose forward takes **kwargs (every MoE ForCausalLM: `model_accepts_loss_kwargs`
True) trained with labels (`num_items_in_batch` not None):
- compute_loss multiplies the model's loss by `accelerator.num_processes` when `average_tokens_across_devices` (True by
  default since #39395; False before), to undo DDP's averaging of the token-summed cross-entropy it divides by the
  global `num_items_in_batch`; the aux term is inside that loss and is multiplied too;
- training_step divides by the accumulation steps only when `(not model_accepts_loss_kwargs or num_items_in_batch is
  None) and compute_loss_func is None` (5.x; 4.4x: `not model_accepts_loss_kwargs and compute_loss_func is None`):
  not here;
- Accelerator.backward divides by the accelerator's gradient_accumulation_steps, which the Trainer leaves at 1;
- DDP averages the gradients over the processes; micro-batch gradients add (no_sync until the last).
`trainer_step` is that (the 5.x defaults); `trainer_step_local_tokens` the same with average_tokens_across_devices
False; `trainer_step_no_loss_kwargs` a model whose forward takes no **kwargs (or `accepts_loss_kwargs = False`): then
training_step divides by the accumulation steps and nothing multiplies. `function_step` applies lossverify's own
contract (the micro-batch weighs 1/(DP GA)) around the function: the function alone; `function_step_no_mask` the
same with no attention_mask (the micro-batch packed into one row), as before #28517 or in padding-free packing. The logged loss is the Trainer's:
the mean over processes of each process's sum of training_step's returned losses. The Trainer logs no separate aux
loss (no stats).

Each modeling file's function is judged on the transformers case by `<model>_function_step`; the implementations are
grouped by their code (docstring and annotations aside; Jamba's `router` names read as `gate`) in `describe`.
"""
import ast
import hashlib
import importlib
import os

import torch

from lossverify.torch import Reduced
from lossverify.torch.kinds.router import micro_batch_weight, backward_weight
from lv_frameworks import Run, checkout, git_commit

NAME = "transformers"
EXPLANATIONS = ["moe-aux-loss-dp-ga-summed", "moe-aux-ga-overweight", "moe-aux-mask-ignored", "moe-aux-padding-counted", "moe-aux-no-grad", "moe-aux-topk-squared",
                "moe-aux-local-counts", "moe-aux-global-topk"]
STUBS = ["every modeling file: only load_balancing_loss_func is read (ast), executed with the module's top-level "
         "imports of torch, torch.nn, torch.nn.functional, math and typing; no other transformers code runs "
         "(LV_HF_IMPORT=1: imported from the installed package instead)",
         "the model's forward: the adapter hands the function the per-layer router logits tuple, num_experts, top_k "
         "and the 2D attention_mask, and adds router_aux_loss_coef * aux_loss, as every MoE ForCausalLM does",
         "the Trainer: its loss scaling (compute_loss, training_step, Accelerator.backward) written out in the adapter "
         "from trainer.py; DDP's averaging is the harness's framework model (grad_reduce avg, ga_reduce sum)"]
LAYOUT = ("one batch row per packed sequence of the rank's micro-batch, right-padded; per-layer logits tuple "
          "[batch x sequence, E] (zeros at padding); attention_mask 1 on valid rows, 0 on padding and masked rows")
REPRESENTATIVE = "mixtral"
# Models whose load_balancing_loss_func has another signature or meaning (not judged): Switch Transformers takes
# (router_probs, expert_indices) per group with router_z_loss_func beside it; Doge routes product keys (num_keys).
OTHER_SIGNATURES = ("switch_transformers", "doge")
_cache = {}


def _package_root(path):
    for candidate in (os.path.join(path, "src", "transformers"), os.path.join(path, "transformers"), path):
        if os.path.isdir(os.path.join(candidate, "models")):
            return candidate
    raise RuntimeError(f"{path}: no transformers package (src/transformers, transformers, or models/) here")


def _modeling_files(root):
    """{model: path} of every models/M/modeling_M.py that defines a 4-argument load_balancing_loss_func."""
    found = {}
    models = os.path.join(root, "models")
    for model in sorted(os.listdir(models)):
        path = os.path.join(models, model, f"modeling_{model}.py")
        if model in OTHER_SIGNATURES or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            if "def load_balancing_loss_func(" in f.read():
                found[model] = path
    return found


def _function_node(path):
    with open(path, encoding="utf-8") as f:
        source = f.read()
    tree = ast.parse(source)
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "load_balancing_loss_func"]
    if not nodes:
        raise RuntimeError(f"{path}: no load_balancing_loss_func")
    return source, tree, nodes[0]


_IMPORTED = ("torch", "math", "typing")


def _read_function(path):
    """load_balancing_loss_func of one modeling file: its source executed with the module's imports of torch/F/typing."""
    source, tree, node = _function_node(path)
    namespace = {"__name__": f"lv_transformers_{os.path.basename(path)[:-3]}"}
    for statement in tree.body:
        if isinstance(statement, ast.Import):
            names = [a for a in statement.names if a.name.split(".")[0] in _IMPORTED]
            if names:
                statement = ast.copy_location(ast.Import(names=names), statement)
                exec(compile(ast.Module([statement], []), path, "exec"), namespace)
        elif isinstance(statement, ast.ImportFrom) and statement.level == 0 and \
                (statement.module or "").split(".")[0] in _IMPORTED:
            exec(compile(ast.Module([statement], []), path, "exec"), namespace)
    exec(compile(ast.Module([node], []), path, "exec"), namespace)
    function = namespace["load_balancing_loss_func"]
    if len([a for a in node.args.args]) != 4:
        raise RuntimeError(f"{path}: load_balancing_loss_func takes {len(node.args.args)} arguments, not 4")
    return function


def _function(model):
    if model not in _cache:
        if os.environ.get("LV_HF_IMPORT") == "1":
            module = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
            _cache[model] = module.load_balancing_loss_func
        else:
            _cache[model] = _read_function(_modeling_files(_package_root(checkout()))[model])
    return _cache[model]


def code_key(path):
    """The function's code without its docstring, annotations and comments (Jamba's router names read as gate)."""
    _, _, node = _function_node(path)
    node = ast.parse(ast.unparse(node)).body[0]
    if node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
        node.body = node.body[1:]
    node.returns = None
    for argument in node.args.args:
        argument.annotation = None
    text = ast.unparse(node).replace("router_logits", "gate_logits").replace("layer_router", "layer_gate")
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _batch(logits, ctx):
    """(tuple of per-layer [B*S, E] router logits, attention_mask [B, S]) of the rank's micro-batch (LAYOUT)."""
    layers = int(ctx.loss.layers)
    width = logits.shape[-1] // layers
    ids = ctx.sequences.tolist()
    order, rows, flat = {}, [], []
    filled = {}
    for row, s in enumerate(ids):
        if s < 0:
            continue
        b = order.setdefault(s, len(order))
        rows.append(row)
        flat.append((b, filled.get(b, 0)))
        filled[b] = filled.get(b, 0) + 1
    batch = max(len(order), 1)
    length = max(list(filled.values()) + [1])
    rows_t = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    index = torch.tensor([b * length + p for b, p in flat], dtype=torch.int64, device=logits.device)
    mask = torch.zeros(batch * length, dtype=torch.int64, device=logits.device)
    if rows:
        mask[index] = ctx.loss_mask[rows_t].long()
    gate_logits = []
    for layer in range(layers):
        part = logits[:, layer * width:(layer + 1) * width]
        dense = part.new_zeros(batch * length, width)
        if rows:
            dense = dense.index_put((index,), part[rows_t])
        gate_logits.append(dense)
    return tuple(gate_logits), mask.reshape(batch, length), width


def _aux_term(logits, ctx, model=REPRESENTATIVE):
    """router_aux_loss_coef * load_balancing_loss_func(outputs.router_logits, num_experts, num_experts_per_tok,
    attention_mask), as the ForCausalLM adds it to its loss."""
    gate_logits, mask, width = _batch(logits, ctx)
    aux = _function(model)(gate_logits, width, int(ctx.loss.top_k), mask)
    return float(ctx.loss.aux_coef) * aux


def _trainer(logits, ctx, average_tokens, accepts_loss_kwargs, model=REPRESENTATIVE):
    term = _aux_term(logits, ctx, model)
    processes = ctx.world_size  # accelerator.num_processes (tp = cp = 1: the DP processes)
    loss = term
    if average_tokens and accepts_loss_kwargs:  # compute_loss: loss *= accelerator.num_processes
        loss = loss * processes
    if not accepts_loss_kwargs:  # training_step: loss / current_gradient_accumulation_steps
        loss = loss / ctx.ga
    # Accelerator.backward: loss / gradient_accumulation_steps (1: the Trainer keeps GA to itself); DDP averages.
    # Logged: the mean over processes of the sum over micro-batches of training_step's returned loss.
    return Reduced(loss, logged=float(loss.detach().double()) / processes)


def trainer_step(logits, labels, ctx):
    """The aux term as the Trainer back-propagates it with its defaults (average_tokens_across_devices True)."""
    return _trainer(logits, ctx, average_tokens=True, accepts_loss_kwargs=True)


def trainer_step_local_tokens(logits, labels, ctx):
    """The same with average_tokens_across_devices False (its default before #39395)."""
    return _trainer(logits, ctx, average_tokens=False, accepts_loss_kwargs=True)


def trainer_step_no_loss_kwargs(logits, labels, ctx):
    """A model whose forward takes no **kwargs (model_accepts_loss_kwargs False): training_step divides by GA."""
    return _trainer(logits, ctx, average_tokens=True, accepts_loss_kwargs=False)


def _function_step(logits, ctx, model):
    term = _aux_term(logits, ctx, model)
    return Reduced(term * backward_weight(ctx), logged=float(term.detach().double()) * micro_batch_weight(ctx))


def function_step(logits, labels, ctx):
    """The function alone, under lossverify's contract (the micro-batch weighs 1/(DP GA))."""
    return _function_step(logits, ctx, REPRESENTATIVE)


def function_step_no_mask(logits, labels, ctx):
    """The function with attention_mask None on the micro-batch packed into one row (padding-free packing, or a
    forward given no 2D mask): every row is counted, the case's masked rows too (what #28517 fixed for padding)."""
    layers = int(ctx.loss.layers)
    width = logits.shape[-1] // layers
    gate_logits = tuple(logits[:, layer * width:(layer + 1) * width] for layer in range(layers))
    term = float(ctx.loss.aux_coef) * _function(REPRESENTATIVE)(gate_logits, width, int(ctx.loss.top_k), None)
    return Reduced(term * backward_weight(ctx), logged=float(term.detach().double()) * micro_batch_weight(ctx))


def _per_model(model):
    def step(logits, labels, ctx):
        return _function_step(logits, ctx, model)
    step.__name__ = f"{model}_function_step"
    step.__doc__ = f"{model}'s load_balancing_loss_func under lossverify's contract."
    return step


def __getattr__(name):  # <model>_function_step for every modeling file that has the function
    if name.endswith("_function_step"):
        return _per_model(name[:-len("_function_step")])
    raise AttributeError(name)


def describe(path):
    root = _package_root(path)
    files = _modeling_files(root)
    groups = {}
    for model, file in files.items():
        groups.setdefault(code_key(file), []).append(model)
    summary = "; ".join(f"{key}: {', '.join(models)}" for key, models in groups.items())
    return {"commit": git_commit(path), "source": f"models/*/modeling_*.py load_balancing_loss_func "
            f"({len(files)} files; by code: {summary}); trainer.py's scaling written out in the adapter"}


def _conventions(loss):
    """transformers' conventions as --set overrides: one loss over every layer's logits pooled, not divided by k, the
    plain top-k of the softmax; no z-loss, sequence or global aux loss (the functions have none); default scaling;
    DDP's average over the processes with micro-batch gradients summed; no sequence parallelism (tp = 1)."""
    overrides = {"loss.divide_by_k": False, "loss.pool_layers": True, "framework.grad_reduce": "avg",
                 "framework.ga_reduce": "sum", "layout.sp": False}
    notes = ["pooled over layers, not divided by k"]
    for key, note in (("z_loss_coef", "z-loss off"), ("seq_aux_coef", "sequence aux off"),
                      ("global_aux_coef", "global aux off")):
        if loss.get(key, 0):
            overrides[f"loss.{key}"] = 0
            notes.append(note)
    if loss.get("scaling", "default") != "default":
        overrides["loss.scaling"] = "default"
        notes.append("default scaling")
    return overrides, notes


# Cases whose router fits the function (softmax scores, a plain top-k), at the Trainer's layouts (tp = cp = 1: DDP).
PLAN = {
    "moe-pooled-transformers-dp2-ga2": [(1, 1), (1, 2), (2, 1), (2, 2)],
    "moe-aux-replicated-tp8-e6": [(2, 2)],
    "moe-aux-sp-tp2-cp2": [(1, 2), (2, 2)],
    "moe-global-aux-dp2-ga2": [(2, 2)],
    "moe-per-token-sp-cp2-dp2": [(2, 2)],
}
FUNCTIONS = [("function_step", "the function under lossverify's contract"),
             ("trainer_step", "Trainer defaults: average_tokens_across_devices True"),
             ("trainer_step_local_tokens", "Trainer: average_tokens_across_devices False"),
             ("trainer_step_no_loss_kwargs", "Trainer: model_accepts_loss_kwargs False")]


def runs(cases):
    out = []
    for name, case in sorted(cases.items()):
        loss = case.get("loss", {})
        if loss.get("kind") != "router" or name not in PLAN:
            continue
        overrides, notes = _conventions(loss)
        for function, note in FUNCTIONS:
            for dp, ga in PLAN[name]:
                out.append(Run(f"{__name__}:{function}", name, {"tp": 1, "cp": 1, "dp": dp, "ga": ga}, overrides,
                               ", ".join(notes + [note])))
    pooled = cases.get("moe-pooled-transformers-dp2-ga2")
    if pooled:
        overrides, notes = _conventions(pooled["loss"])
        for dp, ga in ((1, 1), (2, 2)):
            out.append(Run(f"{__name__}:function_step_no_mask", "moe-pooled-transformers-dp2-ga2",
                           {"tp": 1, "cp": 1, "dp": dp, "ga": ga}, overrides,
                           ", ".join(notes + ["attention_mask None on the packed micro-batch: masked rows counted"])))
        try:
            models = [m for m in _modeling_files(_package_root(checkout())) if m != REPRESENTATIVE]
        except RuntimeError:
            models = []
        for model in models:
            out.append(Run(f"{__name__}:{model}_function_step", "moe-pooled-transformers-dp2-ga2",
                           {"tp": 1, "cp": 1, "dp": 2, "ga": 2}, overrides,
                           ", ".join(notes + [f"{model}'s copy under lossverify's contract"])))
    return out
