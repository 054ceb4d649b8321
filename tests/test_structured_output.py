"""Structured output through the Python API on SmolLM2: 50 generated JSON schemas (greedy and
sampled) whose every output parses and validates, regex, choice and grammar constraints, refusals
that name the field, and constrained and free requests mixed in one batch with nothing compiled
and no page left behind."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from conftest import requires_smollm2
from engine_helpers import count_compilations

jsonschema = pytest.importorskip("jsonschema")

from jaxrunner import SamplingParams  # noqa: E402
from jaxrunner.sampling_params import StructuredOutputsParams  # noqa: E402

pytestmark = [pytest.mark.slow, requires_smollm2]

NUM_SCHEMAS = 50


@pytest.fixture(scope="module")
def llm(smollm2_small):
    return smollm2_small  # the server tests' engine (conftest): loaded and compiled once


def random_schema(rng: np.random.Generator, depth: int = 0) -> dict:
    """An object schema mixing nested objects, arrays, enums, bounded numbers and required fields.
    Strings, arrays and decimals are bounded so that a complete document fits the token budget."""
    properties = {}
    for index in range(int(rng.integers(1, 4))):
        kind = rng.choice(["string", "integer", "number", "boolean", "enum", "array", "object"][:7 if depth < 2 else 5])
        name = f"{kind}_{index}"
        if kind == "string":
            properties[name] = {"type": "string", "maxLength": int(rng.integers(1, 12))}
        elif kind == "integer":
            low = int(rng.integers(-50, 50))
            properties[name] = {"type": "integer", "minimum": low, "maximum": low + int(rng.integers(0, 1000))}
        elif kind == "number":
            # multipleOf bounds the digits (a model may otherwise write decimals until max_tokens)
            properties[name] = {"type": "number", "minimum": -10.5, "maximum": 99.5, "multipleOf": 0.25}
        elif kind == "boolean":
            properties[name] = {"type": "boolean"}
        elif kind == "enum":
            properties[name] = {"enum": ["red", "green", "blue", 7, None][:int(rng.integers(2, 6))]}
        elif kind == "array":
            items = random_schema(rng, depth + 1) if rng.random() < 0.3 else {"type": "integer", "minimum": 0,
                                                                               "maximum": 9}
            properties[name] = {"type": "array", "items": items, "minItems": int(rng.integers(0, 2)), "maxItems": 3}
        else:
            properties[name] = random_schema(rng, depth + 1)
    required = [name for name in properties if rng.random() < 0.7]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _prompt(llm, schema: dict) -> dict:
    """A short request (the constraint, not the prompt, carries the schema: the context is 256 tokens)."""
    keys = ", ".join(schema.get("properties", {}))
    return llm.chat_prompt([{"role": "user", "content": f"Reply in JSON with the keys {keys}."}])


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_every_output_of_50_generated_schemas_parses_and_validates(llm, temperature):
    rng = np.random.default_rng(0)
    schemas = [random_schema(rng) for _ in range(NUM_SCHEMAS)]
    prompts = [_prompt(llm, schema) for schema in schemas]
    # compact JSON: with vLLM's default (any whitespace) a 135M model can indent until max_tokens
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=200,
                             structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
              for i, schema in enumerate(schemas)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for schema, output in zip(schemas, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)


def test_regex_choice_grammar_and_json_object(llm):
    prompt = _prompt(llm, {"type": "string"})
    cases = [
        (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,5}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", t)),
        (StructuredOutputsParams(choice=["yes", "no", "maybe so"]), lambda t: t in ("yes", "no", "maybe so")),
        (StructuredOutputsParams(grammar='root ::= "x=" [0-9] [0-9]?'), lambda t: re.fullmatch(r"x=[0-9]{1,2}", t)),
        (StructuredOutputsParams(grammar='start: "a" "b"+\n'), lambda t: re.fullmatch(r"ab+", t)),
        (StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
         lambda t: isinstance(json.loads(t), dict)),
    ]
    for temperature in (0.0, 1.0):
        outputs = llm.generate([prompt] * len(cases), [
            SamplingParams(temperature=temperature, seed=1, max_tokens=64, structured_outputs=constraint)
            for constraint, _ in cases], use_tqdm=False)
        for (constraint, matches), output in zip(cases, outputs):
            text, reason = output.outputs[0].text, output.outputs[0].finish_reason
            if constraint.kind == "json_object" and reason == "length":
                continue  # an open object may go on past max_tokens; what came is still checked below
            assert matches(text), (constraint, text, reason)


@pytest.mark.parametrize("options, field", [
    (dict(json={"type": "nope"}), "structured_outputs.json"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(regex="(unclosed"), "structured_outputs.regex"),
    (dict(grammar="root ::= ("), "structured_outputs.grammar"),
    (dict(regex="a", choice=["b"]), "structured_outputs"),
    (dict(choice=[]), "structured_outputs.choice"),
])
def test_a_bad_constraint_is_refused_by_name_before_anything_is_queued(llm, options, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(["hi"], SamplingParams(structured_outputs=StructuredOutputsParams(**options)))
    assert not llm.engine.has_unfinished_requests()


def test_constrained_and_free_requests_share_steps_with_no_compile_and_no_page_left(llm):
    rng = np.random.default_rng(1)
    schemas = [random_schema(rng) for _ in range(4)]
    prompts = [_prompt(llm, s) for s in schemas] * 2
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=120,
                             structured_outputs=StructuredOutputsParams(json=s, disable_any_whitespace=True))
              for i, s in enumerate(schemas)]
    params += [SamplingParams(temperature=0.7, seed=i, max_tokens=40) for i in range(4)]
    llm.generate(prompts[:1], params[:1], use_tqdm=False)  # the grammar tokenizer is built before counting
    with count_compilations() as compiles:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert compiles == []
    for schema, output in zip(schemas, outputs[:4]):
        jsonschema.validate(json.loads(output.outputs[0].text), schema)
    assert all(len(o.outputs[0].token_ids) > 0 for o in outputs[4:])
    assert llm.engine.scheduler.allocator.num_used_pages == 0


def test_proposal_masks_follow_the_grammar_and_leave_the_matcher_in_place(llm):
    """Speculative proposals: one mask per place; past a token the grammar refuses, the last repeats."""
    grammars, tokenizer = llm.engine.grammars, llm.get_tokenizer()
    matcher = grammars.matcher(grammars.grammar(StructuredOutputsParams(choice=["yes please", "no"])))
    ids = tokenizer.encode("yes please", add_special_tokens=False)
    start = grammars.fill_bitmask(matcher)

    def allows(mask, token):
        return bool((int(mask[token // 32]) >> (token % 32)) & 1)

    masks = grammars.fill_bitmasks_along(matcher, ids)
    assert len(masks) == len(ids) + 1 and all(allows(masks[j], t) for j, t in enumerate(ids))
    assert not allows(masks[-1], ids[0]) and allows(masks[-1], tokenizer.eos_token_id)
    refused = grammars.fill_bitmasks_along(matcher, [ids[0], ids[0], ids[0]])
    assert not allows(refused[1], ids[0]) and (refused[2] == refused[1]).all() and (refused[3] == refused[1]).all()
    assert (grammars.fill_bitmask(matcher) == start).all()  # rolled back
