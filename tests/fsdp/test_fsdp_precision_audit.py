"""fully_shard's precision audit (tandem/fsdp/precision.py), pure, in one
process: the findings for a grid of held dtypes and ``MixedPrecisionPolicy``
dtypes, the warning fully_shard gives from a built unit, and what is never
audited. ``tandem check``'s report of it runs in tests/tools/test_check.py."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from tandem.fsdp.precision import PrecisionIssue, PrecisionLevel, audit_precision, unit_findings, warn_precision

F64, F32, BF16, F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
P = PrecisionIssue

# (held, param_dtype, reduce_dtype, output_dtype) -> the issues found, in order (warnings first).
GRID = [
    ((F32, None, None, None), []),                                  # fp32 throughout
    ((F32, F32, F32, F32), []),
    ((F32, BF16, F32, None), []),                                   # the recommended mixed precision
    ((F32, BF16, F32, BF16), []),                                   # outputs in the compute dtype
    ((F32, BF16, F32, F32), []),                                    # outputs wider than computed
    ((F64, F32, F64, None), []),
    ((BF16, None, F32, None), [P.REDUCED_THEN_ROUNDED]),            # model.to(bf16), then an fp32 reduce
    ((BF16, BF16, F32, None), [P.REDUCED_THEN_ROUNDED]),
    ((BF16, F32, None, None), [P.REDUCED_THEN_ROUNDED]),            # fp32 compute reduces in fp32 by default
    ((F32, BF16, None, None), [P.REDUCE_DEFAULTS_TO_PARAM]),        # the classic pitfall
    ((F64, F32, None, None), [P.REDUCE_DEFAULTS_TO_PARAM]),
    ((F32, BF16, BF16, None), [P.REDUCE_BELOW_HELD]),               # said on purpose: a note
    ((F32, None, BF16, None), [P.REDUCE_BELOW_PARAM]),
    ((F32, F32, BF16, None), [P.REDUCE_BELOW_PARAM]),
    ((F32, BF16, None, F16), [P.REDUCE_DEFAULTS_TO_PARAM]),         # fp16 outputs keep more bits than bf16
    ((F32, None, None, BF16), [P.OUTPUT_BELOW_PARAM]),
    ((BF16, None, None, None), [P.LOW_PRECISION_MODEL]),            # pure bf16 training
    ((BF16, None, BF16, None), [P.LOW_PRECISION_MODEL]),
    ((F16, None, None, None), [P.LOW_PRECISION_MODEL, P.FLOAT16]),
    ((F32, F16, F32, None), [P.FLOAT16]),
    ((F32, F16, None, None), [P.REDUCE_DEFAULTS_TO_PARAM, P.FLOAT16]),
    ((F16, None, F32, None), [P.REDUCED_THEN_ROUNDED, P.FLOAT16]),
]


@pytest.mark.parametrize("dtypes, issues", GRID, ids=lambda v: "-".join(str(d).removeprefix("torch.")
                                                                      for d in v) if isinstance(v, tuple) else None)
def test_the_findings_for_each_combination_of_dtypes(dtypes, issues):
    held, param, reduce, output = dtypes
    found = audit_precision("Block", ["w", "b"], held, param_dtype=param, reduce_dtype=reduce, output_dtype=output)
    assert [f.issue for f in found] == issues
    for f in found:
        assert f.unit == "Block" and f.params == ("w", "b")
        assert f.what and f.why and f.fix
        assert f.describe().startswith("fully_shard unit 'Block' (parameters 'w', 'b'): ")
    warning = {P.REDUCED_THEN_ROUNDED, P.REDUCE_DEFAULTS_TO_PARAM}
    assert [f.level for f in found] == sorted((f.level for f in found), key=lambda lv: lv.value)
    assert all((f.level is PrecisionLevel.WARNING) == (f.issue in warning) for f in found)


def test_the_two_warnings_name_the_dtypes_and_the_fix():
    rounded, = audit_precision("Block", ["w"], BF16, reduce_dtype=F32)
    assert "reduced in float32, then rounded to bfloat16" in rounded.what
    assert "optimizer state (Adam's moments) is held in bfloat16" in rounded.what
    assert "1/256 of a weight" in rounded.why
    assert rounded.fix == ("keep the model in float32 (do not cast it to bfloat16 before fully_shard); add "
                           "param_dtype=torch.bfloat16 to keep computing in bfloat16")
    pitfall, = audit_precision("Block", ["w"], F32, param_dtype=BF16)
    assert "reduced, and accumulated across backwards without sync, in bfloat16" in pitfall.what
    assert "reduce_dtype is None, so it defaults to param_dtype=torch.bfloat16" in pitfall.what
    assert pitfall.fix.startswith("pass reduce_dtype=torch.float32 to the MixedPrecisionPolicy")


def test_nothing_to_audit_without_trainable_parameters_or_floating_dtypes():
    assert audit_precision("Frozen", [], BF16, reduce_dtype=F32) == []
    assert audit_precision("Codes", ["idx"], torch.int64) == []


def test_where_shortens_a_long_parameter_list():
    f, = audit_precision("Block", [f"p{i}" for i in range(5)], F32, param_dtype=BF16)
    assert f.where == "fully_shard unit 'Block' (parameters 'p0', 'p1', 'p2', ... (5 in all))"


def _unit(name, held, param=None, reduce=None, output=None, frozen=()):
    managed = [SimpleNamespace(fqn=n, requires_grad=n not in frozen) for n in ("weight", "bias")]
    config = SimpleNamespace(param_dtype=param, reduce_dtype=reduce, output_dtype=output)
    return SimpleNamespace(name=name, params=SimpleNamespace(managed=managed, orig_dtype=held), config=config)


def _warn_at_fully_shard(unit):
    """Stands for fully_shard, the function that calls warn_precision."""
    warn_precision(unit_findings(unit))


def test_fully_shard_warns_once_per_unit_with_warnings_and_never_for_notes():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _warn_at_fully_shard(_unit("Block", BF16, reduce=F32))     # a warning
        _warn_at_fully_shard(_unit("Norm", F32, BF16, BF16))       # a note only
        _warn_at_fully_shard(_unit("Head", F32, BF16))             # a warning
        _warn_at_fully_shard(_unit("Frozen", BF16, reduce=F32, frozen=("weight", "bias")))
    assert [w.category for w in caught] == [UserWarning, UserWarning]
    block, head = (str(w.message) for w in caught)
    assert block.startswith("fully_shard unit 'Block' (parameters 'weight', 'bias'): gradients are reduced in "
                            "float32, then rounded to bfloat16")
    assert "Fix: keep the model in float32" in block
    assert head.startswith("fully_shard unit 'Head' (parameters 'weight', 'bias'): gradients are reduced")
    assert "Fix: pass reduce_dtype=torch.float32" in head
    assert all(w.filename == __file__ for w in caught)  # stacklevel: the caller of fully_shard


def test_a_frozen_parameter_is_left_out_of_the_finding():
    f, = unit_findings(_unit("Block", F32, BF16, frozen=("bias",)))
    assert f.params == ("weight",)


def test_identical_blocks_warn_once_under_python_s_default_filter():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(4):  # one call site, as in `for block in model.layers: fully_shard(block)`
            _warn_at_fully_shard(_unit("Block", F32, BF16))
    assert len(caught) == 1
