"""The stand-ins of Megatron-LM's files (tests/loop_standins.py) keep the real files' contract.

FACTS records, per Megatron-LM tag and commit, what was read from the real `pretrain_gpt.py`,
`gpt_builders.py`, `model_provider.py` and `megatron/training/training.py`: each function's
parameters and defaults, the calls that make its contract (what forward_step passes to the
model and hands back, what loss_func returns and checks, how model_provider calls the
builder, which keywords gpt_builder gives GPTModel, how pretrain's get_model calls the model
provider) and the constants the adapters rely on. The tests check every stand-in against the
facts of the tag it stands for, so a stand-in that drifts fails here; with
MEGATRON_LM_GIT=<a git directory of NVIDIA/Megatron-LM> the facts themselves are checked
against the real files at the recorded commits, so a new Megatron-LM is one run away from
showing what changed. Parsed, not imported: runs without megatron.training (.venv too);
the behaviour of the stand-ins (loss_func's values and checks, forward_step's model call)
runs on megatron.training (.venv312)."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field

import pytest

import tests.loop_standins as standins

REQUIRED = "<required>"  # a parameter without a default


@dataclass(frozen=True)
class Fn:
    """One function's contract: its parameters (name, default as source text or REQUIRED),
    the calls (as source text, argument names normalised) that make its contract, and the
    string constants its checks use."""

    params: tuple[tuple[str, str], ...]
    calls: frozenset[str] = field(default_factory=frozenset)
    messages: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class Source:
    commit: str
    files: dict[str, dict[str, Fn]]
    constants: dict[str, dict[str, str]] = field(default_factory=dict)


P_GET_BATCH = (("data_iterator", REQUIRED), ("vp_stage", "None"))
P_LOSS_FUNC = (("loss_mask", REQUIRED), ("output_tensor", REQUIRED), ("model", "None"))
P_FORWARD_STEP = (
    ("data_iterator", REQUIRED),
    ("model", REQUIRED),
    ("return_schedule_plan", "False"),
)
P_DATASETS = (("train_val_test_num_samples", REQUIRED), ("vp_stage", "None"))
P_EMBEDDING_RANKS = (("pp_ranks", REQUIRED),)
P_BUILDER = (
    ("args", REQUIRED),
    ("pre_process", REQUIRED),
    ("post_process", REQUIRED),
    ("vp_stage", "None"),
    ("config", "None"),
    ("pg_collection", "None"),
)
P_MODEL_PROVIDER = (
    ("model_builder", REQUIRED),
    ("pre_process", "True"),
    ("post_process", "True"),
    ("vp_stage", "None"),
    ("config", "None"),
    ("pg_collection", "None"),
)
# the model calls forward_step makes and the loss function it hands back
MODEL_CALL = (
    "model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask, "
    "packed_seq_params=packed_seq_params)"
)
PLAN_CALL = (
    "model.build_schedule_plan(tokens, position_ids, attention_mask, labels=labels, "
    "loss_mask=loss_mask)"
)
LOSS_PARTIAL = "partial(loss_func, loss_mask, model=model)"
LEGACY_CALL = "model(tokens, position_ids, attention_mask, labels=labels)"
CHECKS = frozenset(
    {
        "found NaN in local forward loss calculation",
        "found Inf in local forward loss calculation",
        "Spiky loss",
    }
)
LOSS_RETURN = "return (loss, num_tokens, report)"
BUILDER_CALL = (
    "model_builder(args, pre_process, post_process, vp_stage, config=config, "
    "pg_collection=pg_collection)"
)
GPT_MODEL_KEYWORDS = (
    "config transformer_layer_spec vocab_size max_sequence_length pre_process post_process "
    "fp16_lm_cross_entropy parallel_output share_embeddings_and_output_weights "
    "position_embedding_type rotary_percent rotary_base rope_scaling mtp_block_spec vp_stage "
    "pg_collection"
)


def gpt_model(*keywords: str) -> str:
    """GPTModel's call as the set of keywords given to it."""
    return f"GPTModel({' '.join(sorted(keywords))})"


# get_model's call of the model provider without virtual stages (config: get_model's own,
# None from setup_model_and_optimizer)
GET_MODEL_CALL = (
    "model_provider_func(pre_process=pre_process, post_process=post_process, config=config, "
    "pg_collection=pg_collection)"
)
P_PRETRAIN_V016 = (
    ("train_valid_test_dataset_provider", REQUIRED),
    ("model_provider", REQUIRED),
    ("model_type", REQUIRED),
    ("forward_step_func", REQUIRED),
    ("process_non_loss_data_func", "None"),
    ("extra_args_provider", "None"),
    ("args_defaults", "{}"),
    ("get_embedding_ranks", "None"),
    ("get_position_embedding_ranks", "None"),
    ("non_loss_data_func", "None"),
    ("store", "None"),
    ("inprocess_call_wrapper", "None"),
)
P_PRETRAIN_V019 = (
    ("cfg_container", REQUIRED),
    ("train_valid_test_dataset_provider", REQUIRED),
    ("model_type", REQUIRED),
    ("forward_step_func", REQUIRED),
    ("model_provider", "None"),
    ("process_non_loss_data_func", "None"),
    ("get_embedding_ranks", "None"),
    ("get_position_embedding_ranks", "None"),
    ("non_loss_data_func", "None"),
    ("store", "None"),
    ("inprocess_call_wrapper", "None"),
    ("p2p_communicator", "None"),
    ("pg_collection", "None"),
    ("skip_model_parallel_init", "False"),
)
# __main__'s call of pretrain in each form
MAIN_V016 = (
    "pretrain(train_valid_test_datasets_provider, partial(model_provider, gpt_builder), "
    "ModelType.encoder_or_decoder, forward_step, args_defaults={'tokenizer_type': "
    "'GPT2BPETokenizer'}, extra_args_provider=add_modelopt_args if has_nvidia_modelopt else "
    "None, store=store, get_embedding_ranks=get_embedding_ranks)"
)
MAIN_V019 = (
    "pretrain(full_config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, "
    "forward_step, store=store, get_embedding_ranks=get_embedding_ranks)"
)
PARSE_V019 = (
    "parse_and_validate_args(extra_args_provider=add_modelopt_args if has_nvidia_modelopt "
    "else None, args_defaults={'tokenizer_type': 'GPT2BPETokenizer'})"
)
BATCH_KEYS = (
    "['attention_mask', 'cu_seqlens', 'cu_seqlens_padded', 'hybrid_cp_group', 'labels', "
    "'local_cp_size', 'loss_mask', 'max_seqlen', 'position_ids', 'tokens']"
)


def _v019_files(extra_gpt_keywords: str = "") -> dict[str, dict[str, Fn]]:
    return {
        "pretrain_gpt.py": {
            "get_batch": Fn(P_GET_BATCH),
            "loss_func": Fn(P_LOSS_FUNC, frozenset({LOSS_RETURN}), CHECKS),
            "forward_step": Fn(P_FORWARD_STEP, frozenset({MODEL_CALL, PLAN_CALL, LOSS_PARTIAL})),
            "train_valid_test_datasets_provider": Fn(P_DATASETS),
            "get_embedding_ranks": Fn(P_EMBEDDING_RANKS),
            "__main__": Fn((), frozenset({MAIN_V019, PARSE_V019})),
        },
        "gpt_builders.py": {
            "gpt_builder": Fn(
                P_BUILDER,
                frozenset({gpt_model(*GPT_MODEL_KEYWORDS.split(), *extra_gpt_keywords.split())}),
            )
        },
        "model_provider.py": {"model_provider": Fn(P_MODEL_PROVIDER, frozenset({BUILDER_CALL}))},
        "megatron/training/training.py": {
            "pretrain": Fn(P_PRETRAIN_V019),
            "get_model": Fn((), frozenset({GET_MODEL_CALL})),
        },
    }


FACTS = {
    "core_v0.16.1": Source(
        commit="55ac7082517c3878ae653c07c09c534b8aed49f6",
        files={
            "pretrain_gpt.py": {
                "get_batch": Fn(P_GET_BATCH),
                "loss_func": Fn(P_LOSS_FUNC, frozenset({LOSS_RETURN}), CHECKS),
                "forward_step": Fn(
                    P_FORWARD_STEP, frozenset({MODEL_CALL, PLAN_CALL, LOSS_PARTIAL, LEGACY_CALL})
                ),
                "train_valid_test_datasets_provider": Fn(P_DATASETS),
                "get_embedding_ranks": Fn(P_EMBEDDING_RANKS),
                "__main__": Fn((), frozenset({MAIN_V016})),
            },
            "gpt_builders.py": {
                "gpt_builder": Fn(P_BUILDER, frozenset({gpt_model(*GPT_MODEL_KEYWORDS.split())}))
            },
            "model_provider.py": {
                "model_provider": Fn(P_MODEL_PROVIDER, frozenset({BUILDER_CALL}))
            },
            "megatron/training/training.py": {
                "pretrain": Fn(P_PRETRAIN_V016),
                "get_model": Fn((), frozenset({GET_MODEL_CALL})),
            },
        },
        constants={"pretrain_gpt.py": {"SPIKY_LOSS_FACTOR": "10"}},
    ),
    "core_v0.19.0": Source(
        commit="5be9626709af2722333bf54797c954c09edeada3",
        files=_v019_files(),
        constants={"pretrain_gpt.py": {"SPIKY_LOSS_FACTOR": "10", "BATCH_KEYS": BATCH_KEYS}},
    ),
    # main as read on 2026-12-08: core_v0.19.0's contract; gpt_builder also passes GPTModel
    # megatron-core 0.20's logit_dtype, which 0.19's GPTModel lacks (so the 0.19.0 stand-in
    # stands for main on the megatron-core installed here)
    "main": Source(
        commit="d98e8a64ddf34856e74b24714e3bedb2f5a39553",
        files=_v019_files(" logit_dtype"),
        constants={"pretrain_gpt.py": {"SPIKY_LOSS_FACTOR": "10", "BATCH_KEYS": BATCH_KEYS}},
    ),
}
# the stand-in for each tag; main's keeps core_v0.19.0's but for the keyword above
STANDS_FOR = {
    "core_v0.16.1": "core_v0.16.1",
    "core_v0.19.0": "core_v0.19.0",
    "main": "core_v0.19.0",
}


# ---- reading a file's contract ----


def _params(node: ast.FunctionDef) -> tuple[tuple[str, str], ...]:
    args = [*node.args.posonlyargs, *node.args.args]
    defaults = [REQUIRED] * (len(args) - len(node.args.defaults)) + [
        ast.unparse(d) for d in node.args.defaults
    ]
    kwonly = [
        (a.arg, REQUIRED if d is None else ast.unparse(d))
        for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults, strict=True)
    ]
    return (*((a.arg, d) for a, d in zip(args, defaults, strict=True)), *kwonly)


def _call_text(call: ast.Call) -> str:
    """A call as source text; GPTModel(...) as its keyword names, sorted (the values are how
    each file reads its arguments, the names are the contract)."""
    if ast.unparse(call.func) == "GPTModel":
        return gpt_model(*(k.arg for k in call.keywords))
    return ast.unparse(call)


CONTRACT_CALLS = (
    "model(",
    "model.build_schedule_plan(",
    "partial(loss_func,",
    "model_builder(",
    "GPTModel(",
    "pretrain(",
    "parse_and_validate_args(",
)


def _contract(body: list[ast.stmt], params=()) -> Fn:
    calls, messages = set(), set()
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(node, ast.Return) and node.value is not None:
            text = ast.unparse(node)
            if text.startswith("return (loss, num_tokens"):
                calls.add(text)
        if isinstance(node, ast.Call):
            text = _call_text(node)
            if text.startswith(CONTRACT_CALLS) or (
                text.startswith("model_provider_func(") and "vp_stage" not in text
            ):
                calls.add(text)
            for keyword in node.keywords:
                if keyword.arg == "message":
                    messages.update(_strings(keyword.value))
    return Fn(tuple(params), frozenset(calls), frozenset(messages))


def _strings(node: ast.expr) -> set[str]:
    """A message's text: a constant, or an f-string over a loop of (reject, 'NaN' | 'Inf')
    read as both messages it makes."""
    if isinstance(node, ast.Constant):
        return {node.value}
    if isinstance(node, ast.JoinedStr):
        parts = [v.value if isinstance(v, ast.Constant) else "{}" for v in node.values]
        return {"".join(parts).format(what) for what in ("NaN", "Inf")}
    return set()


def read(source: str, names) -> tuple[dict[str, Fn], dict[str, str]]:
    """The contract of each of `names` in a file's text (`__main__`: the script's block), and
    its module-level constants."""
    tree = ast.parse(source)
    found, constants = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name in names:
            found[node.name] = _contract(node.body, _params(node))
        if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
            found["__main__"] = _contract(node.body)
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                constants[node.targets[0].id] = repr(ast.literal_eval(node.value))
            except ValueError:
                pass
    return found, constants


def _relevant(fact: Fn, seen: Fn) -> Fn:
    """What the fact table records of a file: the calls and messages it names."""
    return Fn(seen.params, seen.calls & fact.calls, seen.messages & fact.messages)


def check(source_text: str, facts: dict[str, Fn], constants: dict[str, str]) -> list[str]:
    """Where a file's text differs from its facts, one line each."""
    found, consts = read(source_text, facts)
    problems = []
    for name, fact in facts.items():
        if name not in found:
            problems.append(f"{name}: missing")
            continue
        seen = _relevant(fact, found[name])
        if fact.params and seen.params != fact.params:
            problems.append(f"{name} parameters: {seen.params} != {fact.params}")
        for call in sorted(fact.calls - seen.calls):
            problems.append(f"{name}: no `{call}` (has {sorted(found[name].calls)})")
        for message in sorted(fact.messages - seen.messages):
            problems.append(f"{name}: no check {message!r}")
    for name, value in constants.items():
        if consts.get(name) != value:
            problems.append(f"{name} = {consts.get(name)} != {value}")
    return problems


# ---- the stand-ins against the facts ----

STANDIN_CASES = [
    (tag, path)
    for tag in ("core_v0.16.1", "core_v0.19.0", "main")
    for path in ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py")
]


@pytest.mark.parametrize(("tag", "path"), STANDIN_CASES)
def test_each_standin_keeps_the_real_files_contract(tag, path):
    facts = dict(FACTS[tag].files[path])
    if tag == "main" and path == "gpt_builders.py":
        # main passes megatron-core 0.20's logit_dtype, which 0.19's GPTModel (installed
        # here) lacks: the 0.19.0 stand-in keeps every other keyword
        facts = {"gpt_builder": Fn(P_BUILDER, frozenset({gpt_model(*GPT_MODEL_KEYWORDS.split())}))}
    text = standins.STANDINS[STANDS_FOR[tag]][path]
    assert check(text, facts, FACTS[tag].constants.get(path, {})) == []


@pytest.mark.parametrize("tag", ["core_v0.16.1", "core_v0.19.0"])
def test_the_standin_pretrain_keeps_the_real_signature_and_get_models_call(tag):
    pretrain = standins.PRETRAIN[tag]
    facts = FACTS[tag].files["megatron/training/training.py"]
    node = ast.parse(textwrap.dedent(inspect.getsource(pretrain))).body[0]
    assert _params(node) == facts["pretrain"].params
    if tag == "core_v0.16.1":
        # the model provider called with get_model's keywords; config None, as
        # setup_model_and_optimizer leaves it (the builder reads the arguments)
        (expected,) = ast.parse(GET_MODEL_CALL).body
        (call,) = [
            n
            for n in ast.walk(node)
            if isinstance(n, ast.Call) and ast.unparse(n.func) == "model_provider"
        ]
        assert [k.arg for k in call.keywords] == [k.arg for k in expected.value.keywords]
        assert {ast.unparse(k.value) for k in call.keywords if k.arg == "config"} == {"None"}


def test_the_forms_and_examples_name_recorded_tags():
    assert set(standins.FORMS.values()) <= set(FACTS)
    assert set(standins.EXAMPLE_TAGS.values()) <= set(FACTS)
    assert set(standins.STANDINS) == set(standins.FORMS.values())


def test_a_drifted_standin_is_seen():
    """The check reads what it claims: a parameter, a model keyword or a check changed in a
    stand-in is reported."""
    text = standins.STANDINS["core_v0.19.0"]["pretrain_gpt.py"]
    facts = FACTS["core_v0.19.0"].files["pretrain_gpt.py"]
    consts = FACTS["core_v0.19.0"].constants["pretrain_gpt.py"]
    for old, new in (
        ("return_schedule_plan=False", "return_schedule_plan=None"),
        ("loss_mask=loss_mask,\n        packed_seq_params", "\n        packed_seq_params"),
        ('message="Spiky loss"', 'message="spiky"'),
        ("SPIKY_LOSS_FACTOR = 10", "SPIKY_LOSS_FACTOR = 5"),
    ):
        assert old in text, old
        assert check(text.replace(old, new, 1), facts, consts), old


# ---- the stand-ins' behaviour, on megatron.training (.venv312) ----

# the stand-in pretrain_gpt.py run as the script it is (its own loss function), then its
# pieces called with the arguments that run parsed: forward_step on one packed row of two
# documents, with a model that records its call, and the loss function it hands back
PROBE = """
import json, runpy, sys
import torch
import tests.loop_standins as standins

standins.install()
runpy.run_path("pretrain_gpt.py", run_name="__main__")
import pretrain_gpt as script

seen = {}

class Recorder(torch.nn.Module):
    vp_stage = None  # as megatron's models carry it

    def forward(self, *args, **kwargs):
        seen["args"], seen["kwargs"] = args, kwargs
        return torch.full(kwargs["labels"].shape, 2.0)

tokens = torch.arange(8).view(1, 8)
mask = torch.tensor([[1.0, 1, 1, 0, 1, 1, 1, 1]])
sample = {
    "tokens": tokens, "labels": tokens + 1, "loss_mask": mask,
    "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]),
    "cu_seqlens": torch.tensor([[0, 4, 8]], dtype=torch.int32),
    "max_seqlen": torch.tensor([4], dtype=torch.int32),
}
model = Recorder()
output, loss_function = script.forward_step(iter([sample]), model)
loss, num_tokens, report = loss_function(output)
packed = seen["kwargs"]["packed_seq_params"]
print("PROBE " + json.dumps({
    "positional": len(seen["args"]),
    "attention_mask": seen["args"][2] is None,
    "keywords": sorted(seen["kwargs"]),
    "loss_mask_passed": torch.equal(seen["kwargs"]["loss_mask"].view(-1), mask.view(-1)),
    "qkv_format": packed.qkv_format,
    "cu_seqlens_q": packed.cu_seqlens_q.view(-1).tolist(),
    "max_seqlen_q": packed.max_seqlen_q,
    "partial": [loss_function.func is script.loss_func,
                loss_function.args[0] is seen["kwargs"]["loss_mask"],
                loss_function.keywords["model"] is model],
    "loss": loss.item(), "loss_dtype": str(loss.dtype),
    "num_tokens": num_tokens.item(), "num_tokens_dtype": str(num_tokens.dtype),
    "report": {k: v.tolist() for k, v in report.items()},
    "embedding_ranks_untied": script.get_embedding_ranks([0, 1]),
}), flush=True)
"""


@pytest.mark.megatron
@pytest.mark.skipif(
    importlib.util.find_spec("megatron.training") is None,
    reason="megatron.training ships with megatron-core 0.17+ (.venv312)",
)
@pytest.mark.parametrize("form", sorted(standins.FORMS))
def test_the_standins_run_as_megatron_lms_script_and_keep_its_contract(
    form, tmp_path, synth_tokenizer
):
    from tests.distributed.launcher import torchrun_env
    from tests.models.test_readme_megatron import ARGS

    standins.write_checkout(tmp_path, standins.FORMS[form])
    shutil.copy(synth_tokenizer, tmp_path / "tokenizer.model")
    (tmp_path / "probe.py").write_text(PROBE)
    tokenizer = [
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        "tokenizer.model",
    ]
    done = subprocess.run(
        [sys.executable, "probe.py", *ARGS, *tokenizer],
        cwd=tmp_path,
        env=torchrun_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    # megatron's own loss function, through the stand-in pretrain: only 'lm loss'
    assert f"OK {form}: lm loss\n" in done.stdout
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("PROBE ")]
    probe = json.loads(line[len("PROBE ") :])
    assert probe == {
        "positional": 3,
        "attention_mask": True,
        "keywords": ["labels", "loss_mask", "packed_seq_params"],
        "loss_mask_passed": True,
        "qkv_format": "thd",
        "cu_seqlens_q": [0, 4, 8],
        "max_seqlen_q": 4,
        "partial": [True, True, True],
        "loss": 14.0,  # 2 per token, 7 unmasked
        "loss_dtype": "torch.float32",
        "num_tokens": 7,
        "num_tokens_dtype": "torch.int32",
        "report": {"lm loss": [14.0, 7.0]},
        "embedding_ranks_untied": [0],  # ARGS: --untie-embeddings-and-output-weights
    }


# ---- the facts against the real files (given a Megatron-LM git directory) ----

MEGATRON_LM_GIT = os.environ.get("MEGATRON_LM_GIT")


@pytest.mark.skipif(
    MEGATRON_LM_GIT is None, reason="MEGATRON_LM_GIT: a git directory of NVIDIA/Megatron-LM"
)
@pytest.mark.parametrize("tag", sorted(FACTS))
def test_the_facts_are_the_real_files(tag):
    source = FACTS[tag]
    problems = []
    for path, facts in source.files.items():
        text = subprocess.run(
            ["git", "-C", MEGATRON_LM_GIT, "show", f"{source.commit}:{path}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        problems += [f"{path}: {p}" for p in check(text, facts, source.constants.get(path, {}))]
    if tag != "main":  # a tag names one commit
        named = subprocess.run(
            ["git", "-C", MEGATRON_LM_GIT, "rev-parse", f"{tag}^{{commit}}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert named == source.commit
    assert problems == []
