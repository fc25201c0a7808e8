"""A real tool call end to end: the tiny model, trained for a few seconds to write one
calculator call, samples it on the HF engine; `ToolEnv` parses and runs it; the result comes
back as observation tokens the model's next turn is sampled after.

Why train: an untrained tiny model writes noise and would never produce a well-formed call,
and scripting the engine's answer would not test the engine. Teacher-forcing the call after the
exact prompt the rollout renders until greedy decoding reproduces every token makes the first
turn deterministic while everything downstream (sampling, parsing, the tool, the observation
ids, the masks) runs for real.
"""

from __future__ import annotations

import torch
from response_templates import QWEN3_XML

import rlblocks as rb
from rlblocks.envs import AgentEngine, ChatFormat, ToolEnv, calculator

QUESTION = "What is 12 + 7?"
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 7"}}\n</tool_call>'


def trained_to_call(prompt: list[int], target: list[int]) -> torch.nn.Module:
    """The tiny model (context 1024: the tool description alone is ~500 tiny tokens) trained
    until greedy decoding after ``prompt`` gives ``target``; fails the test if it never does."""
    model, _ = rb.models.tiny(seed=0, max_position_embeddings=1024)
    ids = torch.tensor([prompt + target])
    labels = torch.full_like(ids, -100)
    labels[0, len(prompt) :] = ids[0, len(prompt) :]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for step in range(600):
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 9:
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
            if logits.argmax(-1).tolist() == target:
                return model.eval()
    raise AssertionError("the tiny model did not learn to write the tool call in 600 steps")


def test_a_sampled_tool_call_is_run_and_its_result_observed():
    tokenizer = rb.models.tiny_tokenizer()
    env = ToolEnv([calculator])
    fmt = ChatFormat(tokenizer, env.tools)
    _, prompt = fmt.prompt(env.reset(QUESTION, {}))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    target = fmt.encode(CALL) + [im_end]  # the call, then the end of the turn
    model = trained_to_call(prompt, target)
    engine = rb.rollout.HFEngine(model, tokenizer, progress=False)
    agent = AgentEngine(engine, env, max_turns=2)
    greedy = rb.SamplingParams(max_new_tokens=len(target) + 4, temperature=0)
    ro = agent.generate([QUESTION], sampling=greedy, metadata=[{"ground_truth": "19"}])

    assert ro.prompt_ids[0][ro.prompt_mask[0]].tolist() == prompt
    real = ro.response_attention_mask[0]
    response, mask = ro.response_ids[0][real].tolist(), ro.response_mask[0][real].tolist()
    assert response[: len(target)] == target and all(mask[: len(target)])
    # The model sampled <|im_end|>: the observation starts with the newline the template puts
    # after it, then the tool's message and the next assistant header, none of it trained.
    observation = "\n<|im_start|>tool\n19<|im_end|>\n<|im_start|>assistant\n"
    obs_ids = fmt.encode(observation)
    after = response[len(target) : len(target) + len(obs_ids)]
    assert after == obs_ids and not any(mask[len(target) : len(target) + len(obs_ids)])
    assert all(mask[len(target) + len(obs_ids) :])  # the second turn: the model's again
    info = ro.metadata[0]["agent"]
    assert info["messages"][1] == {"role": "assistant", "content": CALL}
    assert info["messages"][2] == {"role": "tool", "name": "calculator", "content": "19"}
    assert info["tool_calls"] >= 1 and info["turns"] == 2
    assert ro.metadata[0]["ground_truth"] == "19"
    _, metrics = rb.envs.env_reward(ro)
    assert metrics["agent/tool_call_rate"] == 1.0


#: Qwen3-Coder's call format, which only its response template reads
#: (tests/response_templates.py): the JSON parser would flag it as bad JSON.
XML_CALL = (
    "<tool_call>\n<function=calculator>\n<parameter=expression>\n12 + 7\n</parameter>\n"
    "</function>\n</tool_call>"
)


def test_a_call_in_the_tokenizers_own_format_is_read_by_its_template_and_run():
    tokenizer = rb.models.tiny_tokenizer()
    tokenizer.response_template = QWEN3_XML  # as a model's tokenizer_config.json may ship it
    env = ToolEnv([calculator])
    fmt = ChatFormat(tokenizer, env.tools)
    _, prompt = fmt.prompt(env.reset(QUESTION, {}))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    target = fmt.encode(XML_CALL) + [im_end]
    model = trained_to_call(prompt, target)
    engine = rb.rollout.HFEngine(model, tokenizer, progress=False)
    agent = AgentEngine(engine, env, max_turns=2)  # the parser: chosen from the tokenizer
    assert isinstance(agent.parser, rb.envs.ResponseTemplateParser)
    greedy = rb.SamplingParams(max_new_tokens=len(target) + 4, temperature=0)
    ro = agent.generate([QUESTION], sampling=greedy, metadata=[{"ground_truth": "19"}])

    info = ro.metadata[0]["agent"]
    assert info["messages"][1] == {"role": "assistant", "content": XML_CALL}
    assert info["messages"][2] == {"role": "tool", "name": "calculator", "content": "19"}
    assert info["tool_calls"] == 1 and info.get("tool_errors", 0) == 0
    # The same turn with the JSON parser: a call it cannot read, answered with an error.
    json_agent = AgentEngine(engine, env, max_turns=2, parser=rb.envs.parse_tool_calls)
    ro = json_agent.generate([QUESTION], sampling=greedy, metadata=[{"ground_truth": "19"}])
    tool_message = ro.metadata[0]["agent"]["messages"][2]
    assert tool_message["content"].startswith("Error: the tool call is not valid JSON")
