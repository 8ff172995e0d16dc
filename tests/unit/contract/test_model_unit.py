"""Unit tests of contract.model: the model defaults, and that the job schema and the model library both use them."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from rankctl.contract import model as D
from rankctl.kinds.train.spec import ModelSpec, MoeSpec

DEFAULTS = {"FFN_HIDDEN": None, "POSITION_EMBEDDING": "learned", "TIE_EMBEDDINGS": True, "MOE_TOP_K": 2,
            "MOE_EVERY": 1, "MOE_AUX_LOSS": 0.01, "MOE_CAPACITY_FACTOR": None}


def test_the_model_defaults_have_their_documented_values() -> None:
    assert {name: getattr(D, name) for name in DEFAULTS} == DEFAULTS


def test_the_module_holds_these_constants_only_and_imports_nothing() -> None:
    tree = ast.parse(Path(D.__file__).read_text())
    assigned = [t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets]
    assert sorted(assigned) == sorted(DEFAULTS)
    assert not [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def test_the_job_schemas_model_section_defaults_to_them() -> None:
    model = ModelSpec()
    assert (model.ffn_hidden, model.position_embedding, model.tie_embeddings) == (
        D.FFN_HIDDEN, D.POSITION_EMBEDDING, D.TIE_EMBEDDINGS)
    moe = MoeSpec(experts=4)
    assert (moe.top_k, moe.every, moe.aux_loss, moe.capacity_factor) == (
        D.MOE_TOP_K, D.MOE_EVERY, D.MOE_AUX_LOSS, D.MOE_CAPACITY_FACTOR)


def test_the_model_librarys_configs_default_to_them() -> None:
    from rankctl.models.gpt import GPTConfig
    from rankctl.models.moe import MoEConfig

    gpt = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    moe = {f.name: f.default for f in dataclasses.fields(MoEConfig)}
    assert (gpt["ffn_hidden"], gpt["position_embedding"], gpt["tie_embeddings"]) == (
        D.FFN_HIDDEN, D.POSITION_EMBEDDING, D.TIE_EMBEDDINGS)
    assert (moe["top_k"], moe["every"], moe["aux_loss"], moe["capacity_factor"]) == (
        D.MOE_TOP_K, D.MOE_EVERY, D.MOE_AUX_LOSS, D.MOE_CAPACITY_FACTOR)
