"""Input checks that are pure functions (no mlx, no ray): Unicode, seeds, non-object bodies."""

from __future__ import annotations

import json

import pytest

from deployments.errors import BadRequestError
from deployments.ingress.http_api import validation_body
from deployments.ingress.protocol import SEED_MODULUS, Limits, check_text, make_samplings
from deployments.ingress.schemas import CompletionRequest
from engine.core.types import SamplingParams

LIMITS = Limits(max_model_len=128, vocab_size=100, max_n=4)


def test_lone_surrogates_are_refused_with_the_field():
    assert check_text("héllo ✓", "prompt") == "héllo ✓"
    text = json.loads('"ab\\ud800"')  # what Python's json makes of a lone surrogate escape
    with pytest.raises(BadRequestError) as err:
        check_text(text, "messages.0.content")
    assert err.value.param == "messages.0.content" and "character 2" in err.value.message


def test_lone_surrogate_in_stop_is_refused():
    req = CompletionRequest(model="m", prompt="x", stop=[json.loads('"\\udfff"')])
    with pytest.raises(BadRequestError) as err:
        make_samplings(req, 4, LIMITS)
    assert err.value.param == "stop"


@pytest.mark.parametrize("seed, n", [(-1, 1), (-(1 << 63), 2), (SEED_MODULUS - 1, 3), (0, 4)])
def test_any_accepted_seed_maps_into_the_engine_range(seed, n):
    req = CompletionRequest(model="m", prompt="x", seed=seed, n=n, temperature=1.0)
    seeds = [s.seed for s in make_samplings(req, 4, LIMITS)]
    assert all(0 <= s < SEED_MODULUS for s in seeds) and len(set(seeds)) == n


@pytest.mark.parametrize("seed", [-(1 << 63) - 1, SEED_MODULUS])
def test_seeds_outside_int64_and_uint64_are_refused_by_the_schema(seed):
    with pytest.raises(ValueError, match="seed"):
        CompletionRequest(model="m", prompt="x", seed=seed)


@pytest.mark.parametrize("seed", [-1, SEED_MODULUS, 1.5])
def test_engine_sampling_params_refuse_seeds_mlx_cannot_take(seed):
    # mx.random.key raises on these; on the engine thread that used to kill the engine loop
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(temperature=1.0, seed=seed)


@pytest.mark.parametrize("body_error", [
    {"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be a valid dictionary"},
    {"type": "dict_type", "loc": ("body",), "msg": "Input should be a valid dictionary"},
])
def test_non_object_body_is_named(body_error):
    error = validation_body([body_error])["error"]
    assert error["message"] == "the request body must be a JSON object" and error["code"] == "invalid_body"
