"""Agentic rollouts: tools from typed functions, call formats, the environment's error policy, token-in/token-out
trajectories and their masks, and the multi-turn loop's endings."""

from __future__ import annotations

import math
import os
import random
import time
from collections import Counter

import pytest
import torch

from hybridflow_lab.agents import (
    CALL_FORMATS,
    AgentLimits,
    MalformedCall,
    ObservationRenderer,
    StepResult,
    ToolEnvironment,
    ToolPolicy,
    as_tool,
    run_episodes,
    trajectories_batch,
)
from hybridflow_lab.agents.environments import LocalEnvironments
from hybridflow_lab.algorithms.masked import token_level
from hybridflow_lab.engines.stop_strings import StopStrings
from hybridflow_lab.models.tokenizers import char_tokenizer, train_bpe_tokenizer
from hybridflow_lab.tasks.base import Example
from hybridflow_lab.tasks.calculator import CalculatorTask, calc

PLAIN, HERMES = CALL_FORMATS["plain"], CALL_FORMATS["hermes"]


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def test_a_tools_schema_comes_from_its_signature_and_docstring_and_a_bare_function_is_refused():
    tool = as_tool(multiply)
    assert tool.schema == {"type": "function", "function": {
        "name": "multiply", "description": "Multiply two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "the first factor"},
                                                        "b": {"type": "integer", "description": "the second factor"}},
                       "required": ["a", "b"]}, "return": {"type": "integer"}}}
    assert tool(["12", "3"]) == 36 and tool({"a": 2, "b": 5}) == 10  # plain calls' text converted by the schema

    def bare(x: int) -> int:
        return x

    with pytest.raises(ValueError, match=r"tool 'bare'.*an 'Args:' section with one 'name: description' line"):
        as_tool(bare)


def test_call_formats_read_hermes_json_and_plain_calls_and_name_what_is_malformed():
    text = 'I will multiply.<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
    [call] = HERMES.calls(text)
    assert (call.name, call.arguments) == ("multiply", {"a": 3, "b": 4})
    assert HERMES.calls("the answer is 12") == []
    with pytest.raises(MalformedCall, match="not JSON"):
        HERMES.calls("<tool_call>{name: multiply}</tool_call>")
    with pytest.raises(MalformedCall, match="not closed"):
        HERMES.calls('<tool_call>{"name": "multiply"')
    [call] = PLAIN.calls("[calc 123*456]")
    assert (call.name, call.arguments) == ("calc", ["123*456"])
    assert PLAIN.calls("[multiply 3, 4]")[0].arguments == ["3", "4"]
    with pytest.raises(MalformedCall, match=r"\[name arg1, arg2\]"):
        PLAIN.calls("[12*3")
    for call_format, arguments in ((HERMES, {"a": 3, "b": 4}), (PLAIN, ["3", "4"])):  # a written call reads back
        [call] = call_format.calls(call_format.call_text("multiply", {"a": 3, "b": 4}))
        assert (call.name, call.arguments) == ("multiply", arguments)


def test_tool_errors_timeouts_non_text_and_huge_results_become_counted_observations_or_end_the_trajectory():
    def slow(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: how long
        """
        time.sleep(seconds)
        return "woke"

    def broken(x: int) -> str:
        """Fail.

        Args:
            x: ignored
        """
        raise RuntimeError("disk full")

    def table(n: int) -> object:
        """Return something that is not text.

        Args:
            n: rows
        """
        return {"rows": n}

    def long(n: int) -> str:
        """Return n characters.

        Args:
            n: how many
        """
        return "x" * n

    env = ToolEnvironment([slow, broken, table, long, calc], PLAIN, CalculatorTask().reward,
                          ToolPolicy(timeout_s=0.2, max_result_chars=10))
    env.reset(Example("2*3=", "6", "calculator"))
    outcomes = {text: env.step(text) for text in
                ("[slow 5]", "[broken 1]", "[table 2]", "[long 25]", "[nope 1]", "[calc 2*", "[calc 2*3]", "6")}
    assert outcomes["[slow 5]"].observation == "error: slow timed out after 0.2 s"
    assert outcomes["[slow 5]"].counts["tool_timeouts"] == 1
    assert outcomes["[broken 1]"].observation == "error: broken failed: RuntimeError: disk full"
    assert outcomes["[table 2]"].observation == "error: table returned a dict, not text"
    assert outcomes["[long 25]"].observation == "xxxxxxxxxx... [15 more characters cut]"
    assert outcomes["[nope 1]"].observation.startswith("error: no tool named 'nope'; tools: slow, broken")
    assert outcomes["[calc 2*"].counts == {"call_attempts": 1.0, "malformed_calls": 1.0}
    assert outcomes["[calc 2*3]"].observation == "6" and outcomes["[calc 2*3]"].counts["call_ok"] == 1
    assert not any(o.done for text, o in outcomes.items() if text != "6")
    assert outcomes["6"] == StepResult(reward=1.0, done=True)  # no call: the final answer, scored by the task
    strict = ToolEnvironment([broken], PLAIN, CalculatorTask().reward, ToolPolicy(end_on_error=True))
    strict.reset(Example("2*3=", "6", "calculator"))
    assert strict.step("[broken 1]") == StepResult(reward=0.0, done=True, counts={"call_attempts": 1.0,
                                                                                    "tool_calls": 1.0,
                                                                                    "tool_s": pytest.approx(0, abs=1),
                                                                                    "tool_errors": 1.0})


class Scripted:
    """A policy whose turns are given token ids: ``turns[i]`` for every trajectory's i-th turn."""

    def __init__(self, turns: list[list[int]]) -> None:
        self.turns, self.contexts = turns, []

    def __call__(self, contexts: list[list[int]], max_new_tokens: int, turn: int) -> list[tuple[list[int],
                                                                                           list[float]]]:
        self.contexts.append(contexts)
        ids = self.turns[turn]
        return [(ids, [-0.25 - i for i in range(len(ids))]) for _ in contexts]


class Echo:
    """Answers each turn with ``reply`` until the turn holds ``done``; rewards the final turn 1."""

    def __init__(self, reply: str = "b b", done: str = "END") -> None:
        self.reply, self.done = reply, done

    def reset(self, example: Example) -> str:
        return example.prompt

    def step(self, action: str) -> StepResult:
        if self.done in action:
            return StepResult(reward=1.0, done=True)
        return StepResult(self.reply, role="user")


def test_the_training_tokens_are_the_sampled_tokens_where_decode_then_encode_would_differ():
    tokenizer = train_bpe_tokenizer(["ab ab  ab abab  b b END"] * 50, vocab_size=300)
    a, b, space = (tokenizer.convert_tokens_to_ids(t) for t in ("a", "b", "Ġ"))
    merged = tokenizer("ab  ab", add_special_tokens=False)["input_ids"]
    policy = [[a, b, space, space, a], tokenizer("END", add_special_tokens=False)["input_ids"]]
    assert len(merged) < len(policy[0])  # a BPE merge ("ab") and merged whitespace: re-encoding changes the ids
    renderer = ObservationRenderer(tokenizer, PLAIN, chat=False)
    [trajectory] = run_episodes(Scripted(policy), LocalEnvironments([Echo()]), [Example("ab", "", "t")],
                                lambda text: tokenizer(text, add_special_tokens=False)["input_ids"], renderer,
                                AgentLimits(max_turns=3, max_tokens=64))
    observation = tokenizer("\nb b\n", add_special_tokens=False)["input_ids"]
    tensors, columns = trajectories_batch([trajectory], tokenizer.pad_token_id)
    row = tensors["responses"][0][tensors["attention_mask"][0, 1:].bool()].tolist()
    assert row == policy[0] + observation + policy[1]  # token in, token out
    decoded = tokenizer.decode(row)
    assert tokenizer(decoded, add_special_tokens=False)["input_ids"] != row  # what re-encoding would have trained on
    assert columns["response_text"][0] == decoded and columns["ended"] == ["answer"]


def test_observation_tokens_are_context_the_loss_never_trains_on_and_have_no_rollout_log_probs():
    tokenizer = char_tokenizer()
    ids = [tokenizer.convert_tokens_to_ids(c) for c in "[calc 2*3]"]
    renderer = ObservationRenderer(tokenizer, PLAIN, chat=False)
    env = ToolEnvironment([calc], PLAIN, CalculatorTask().reward)
    answer = [tokenizer.convert_tokens_to_ids("6"), tokenizer.eos_token_id]
    [trajectory] = run_episodes(Scripted([ids, answer]), LocalEnvironments([env]),
                                [Example("2*3=", "6", "calculator")],
                                lambda text: tokenizer(text, add_special_tokens=False)["input_ids"], renderer,
                                AgentLimits(max_turns=3, max_tokens=64))
    tensors, columns = trajectories_batch([trajectory], tokenizer.pad_token_id)
    observed = len(tokenizer(" -> 6\n", add_special_tokens=False)["input_ids"])
    assert tensors["response_mask"][0].tolist() == [1] * len(ids) + [0] * observed + [1, 1]
    assert tensors["attention_mask"][0].tolist() == [1] * (4 + len(ids) + observed + 2)
    assert (tensors["rollout_log_probs"][0, len(ids): len(ids) + observed] == 0).all()
    assert tensors["rollout_log_probs"][0, -2:].tolist() == [-0.25, -1.25]
    assert columns["response_text"] == ["[calc 2*3] -> 6\n6"] and columns["answer_text"] == ["6"]
    assert columns["turn_rewards"] == [[0.0, 1.0]] and columns["tool_calls"].tolist() == [1]
    scores = token_level(torch.tensor([1.0]), tensors["response_mask"])
    assert scores[0].nonzero().flatten().tolist() == [len(ids) + observed + 1]  # on the policy's last token


def test_trajectories_end_by_answer_turn_budget_token_budget_or_a_raising_environment():
    tokenizer = char_tokenizer()
    renderer = ObservationRenderer(tokenizer, PLAIN, chat=False)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    x = encode("x")

    class Raising(Echo):
        def step(self, action: str) -> StepResult:
            raise KeyError("state lost")

    def ended(env, limits, turns=(x, x, x)):
        [trajectory] = run_episodes(Scripted(list(turns)), LocalEnvironments([env]), [Example("q", "", "t")], encode,
                                    renderer, limits)
        return trajectory

    assert ended(Echo(), AgentLimits(max_turns=2)).ended == "turns"
    long_reply = ended(Echo(reply="y" * 40), AgentLimits(max_turns=4, max_tokens=30))
    assert long_reply.ended == "tokens" and long_reply.length <= 30 and len(long_reply.turns) == 1
    raising = ended(Raising(), AgentLimits())
    assert raising.ended == "error" and raising.score == 0.0
    eos = [*x, tokenizer.eos_token_id]  # a chat turn ends with EOS: the environment decides whether it goes on
    assert ended(Echo(), AgentLimits(max_turns=2), turns=[eos, eos]).ended == "turns"  # a user answered it
    answered = ended(ToolEnvironment([calc], PLAIN, CalculatorTask().reward), AgentLimits(), turns=[eos])
    assert answered.ended == "answer" and len(answered.turns) == 1  # no call: the tool environment's answer


def test_a_stop_string_is_detected_at_the_token_that_completes_it():
    tokenizer = char_tokenizer()
    stop = StopStrings(tokenizer, ("]", "</tool_call>"))
    for text, completes in (("[calc 1]", True), ("abc</tool_call>", True), ("</tool_cal", False), ("x]y", False)):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert bool(stop.completed(torch.tensor([ids]), torch.tensor(ids[-1:]))[0]) is completes, text


def test_vllms_stop_ids_are_the_tokens_where_the_built_in_engine_stops_merged_bpe_tokens_included():
    from hybridflow_lab.engines.stop_strings import single_token_stops

    tokenizer = train_bpe_tokenizer(["[calc 1*2]] -> 2", "x]) y]) [calc 3]."] * 50, vocab_size=300)
    stop = StopStrings(tokenizer, ("]",))
    ids = single_token_stops(tokenizer, ("]",))
    merged = tokenizer("[calc 1*2]).", add_special_tokens=False)["input_ids"]
    closing = next(i for i in merged if tokenizer.decode([i]) == "])")  # "]" merged with what follows
    assert closing in ids and tokenizer.convert_tokens_to_ids("]") in ids
    prefix = merged[: merged.index(closing) + 1]
    assert stop.completed(torch.tensor([prefix]), torch.tensor(prefix[-1:]))[0]  # both engines stop there
    assert {tokenizer.decode([i]) for i in ids} == {text for text in tokenizer.batch_decode(
        [[i] for i in range(len(tokenizer))]) if "]" in text}
    with pytest.raises(ValueError, match="'calc ' is 2 tokens"):
        single_token_stops(tokenizer, ("calc ",))


def test_a_special_tokens_text_does_not_complete_a_stop_string():
    """As vLLM decodes for its stop strings: a special token (here ``<bos>``) is no text, so ``<`` is not in it."""
    tokenizer = char_tokenizer()
    stop = StopStrings(tokenizer, ("<",))
    ids = [*tokenizer("ab", add_special_tokens=False)["input_ids"], tokenizer.bos_token_id]
    assert not stop.completed(torch.tensor([ids]), torch.tensor(ids[-1:]))[0]
    less = tokenizer("<", add_special_tokens=False)["input_ids"]
    assert stop.completed(torch.tensor([ids + less]), torch.tensor(less))[0]


@pytest.mark.parametrize("remove_padding", [False, True])
def test_the_trainers_log_probs_of_a_multi_turn_trajectory_equal_the_engines_at_every_policy_token(model_dir,
                                                                                                 remove_padding):
    """The built-in engine samples each turn over the whole context (observations included); the training forward
    over the trajectory batch scores the policy's tokens alike, and nothing at the observations."""
    from hybridflow_lab.agents.trajectory import left_padded
    from hybridflow_lab.engines.forward import response_log_probs
    from hybridflow_lab.engines.sampling import SamplingParams
    from hybridflow_lab.engines.torch_rollout import TorchRollout
    from hybridflow_lab.models import load_causal_lm
    from hybridflow_lab.models.tokenizers import load_tokenizer
    from hybridflow_lab.protocol import DataBatch

    tokenizer, model = load_tokenizer(model_dir), load_causal_lm(model_dir).eval()
    engine = TorchRollout(model, SamplingParams(), tokenizer.eos_token_id, tokenizer.pad_token_id,
                          tokenizer=tokenizer)

    def generate(contexts, max_new_tokens, turn):
        tokens, mask = left_padded(contexts, tokenizer.pad_token_id)
        out = engine.generate(tokens, mask, SamplingParams(max_new_tokens=max_new_tokens, stop=("]",), seed=turn))
        real = out["response_mask"].bool()
        return [(ids[keep].tolist(), lp[keep].tolist())
                for ids, keep, lp in zip(out["responses"], real, out["rollout_log_probs"], strict=True)]

    examples = [Example(f"{n}*7=", str(7 * n), "t") for n in (12, 345, 6)]
    trajectories = run_episodes(generate, LocalEnvironments([Echo(reply="ok") for _ in examples]), examples,
                                lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
                                ObservationRenderer(tokenizer, PLAIN, chat=False),
                                AgentLimits(max_turns=3, max_tokens=40, max_new_tokens=8))
    tensors, _ = trajectories_batch(trajectories, tokenizer.pad_token_id)
    assert (tensors["response_mask"] != tensors["attention_mask"][:, -tensors["responses"].shape[1]:]).any()
    with torch.no_grad():
        log_probs, _ = response_log_probs(model, DataBatch(tensors), remove_padding=remove_padding)
    policy = tensors["response_mask"].bool()
    torch.testing.assert_close(log_probs[policy], tensors["rollout_log_probs"][policy], atol=1e-4, rtol=0)
    if remove_padding:
        assert (log_probs[~policy] == 0).all()


def test_a_calculator_lab_rolls_out_trajectories_cell_by_cell_counts_turns_calls_and_endings_and_shows_them(
        model_dir, tmp_path):
    from hybridflow_lab.trainer.lab import Lab
    from tests.test_lab import local_overrides

    lab = Lab("calculator_grpo", overrides=local_overrides(model_dir, tmp_path / "run", "rollout.max_new_tokens=12",
                                                           "agent.max_tokens=30", "task.eval_size=4"))
    try:
        batch = lab.generate(lab.next_prompts(2))
        assert len(batch) == 2 * lab.config.batch.samples_per_prompt
        real = batch["attention_mask"][:, batch["prompts"].shape[1]:].bool()
        assert (batch["response_mask"].bool() <= real).all()  # the policy's tokens are among the real ones
        assert all(len(rewards) == turns for rewards, turns in zip(batch["turn_rewards"], batch["turns"],
                                                                   strict=True))
        assert set(batch["ended"]) <= {"answer", "turns", "tokens"}
        metrics = lab.step()
        assert metrics["agent/turns/mean"] >= 1 and sum(metrics[f"agent/ended/{k}"] for k in
                                                         ("answer", "turns", "tokens", "error")) == pytest.approx(1)
        assert metrics["critic/score/mean"] == pytest.approx(
            float(sum(sum(r) for r in lab.last_batch["turn_rewards"])) / len(lab.last_batch))
        steps = lab.telemetry.spans(role="environment")  # every turn of every trajectory answered, on the timeline
        assert len(steps) >= len(batch) + len(lab.last_batch) and {s.name for s in steps} <= {"tool", "environment"}
        graph = lab.graph()  # each generation's environment is a node before the reward, with its calls
        stage_of = {node.key: node.stage for node in graph.nodes}
        environments = [node for node in graph.nodes if node.stage == "environment"]
        assert len(environments) == 2 and {node.model for node in environments} == {"environment"}
        assert sum(node.calls for node in environments) == sum(s.name == "tool" for s in steps if s.step == graph.step)
        edges = {(stage_of[e.source], stage_of[e.target]) for e in graph.edges}
        assert {("generate", "environment"), ("environment", "reward")} <= edges
        shown = lab.show(rows=2)  # turn by turn: the policy's turns trained on, observations marked as context
        assert list(shown.data["trajectory"][0][0]) == ["role", "text", "trained", "reward"]
        page = shown.to_html()
        assert "policy · trained · reward" in page and page.count("context, not trained on") == sum(
            part["role"] != "policy" for row in shown.data["trajectory"] for part in row)
        assert set(lab.evaluate()) == {"eval/accuracy", "eval/score", "eval/response_length", "eval/agent/tool_use",
                                       "eval/agent/calls/ok_share", "eval/agent/turns/mean"}
        assert set(lab.last_eval["ended"]) <= {"answer", "turns", "tokens"}
    finally:
        lab.shutdown()


def test_the_python_tool_runs_code_in_a_child_process_and_reports_what_it_printed_or_its_error():
    from hybridflow_lab.agents.python_tool import python_tool

    tool = python_tool(timeout_s=5)
    assert tool({"code": "print(2**100)"}) == str(2**100)
    assert tool({"code": f"import os; print(os.getpid() != {os.getpid()})"}) == "True"  # another process
    assert tool({"code": "1/0"}) == "error: ZeroDivisionError: division by zero"
    assert tool({"code": "x = 3"}) == "(nothing printed: print the result)"
    assert tool.name == "python" and list(tool.parameters) == ["code"]


def test_the_python_tool_refuses_network_and_processes_and_stops_runaway_code():
    from hybridflow_lab.agents.python_tool import python_tool

    tool = python_tool(timeout_s=2, memory_mb=256)
    network = tool({"code": "import socket; socket.create_connection(('127.0.0.1', 9))"})
    assert network.startswith("error: PermissionError: socket.") and "not allowed" in network
    assert "subprocess.Popen is not allowed" in tool({"code": "import subprocess; subprocess.run(['ls'])"})
    assert "os.system is not allowed" in tool({"code": "import os; os.system('ls')"})
    assert "import ctypes is not allowed" in tool({"code": "import ctypes"})
    assert "MemoryError" in tool({"code": "x = bytearray(512 * 2**20); print(len(x))"})
    assert tool({"code": "print('started', flush=True)\nwhile True: pass"}) == (
        "started\nerror: the code ran past 2 s and was stopped")  # the loop never ends: the child is killed


def test_the_configs_multi_turn_tasks_are_the_bundled_tasks_with_tools():
    """The config sizes vLLM's context and the token budgets for trajectories by this list (config can't import
    the tasks)."""
    from hybridflow_lab.config.sequence_length import MULTI_TURN_TASKS
    from hybridflow_lab.tasks import TASKS

    assert set(MULTI_TURN_TASKS) == {name for name, task in TASKS.items() if getattr(task, "tools", ())}


def timed_pid(seconds: float) -> str:
    """Sleep, then say which process ran the call and when it started and ended.

    Args:
        seconds: how long to sleep
    """
    start = time.time()
    time.sleep(float(seconds))
    return f"{os.getpid()} {start} {time.time()}"


@pytest.mark.ray
def test_an_environment_pool_steps_trajectories_on_its_workers_at_once_and_names_a_hung_worker(ray_cluster):
    from hybridflow_lab.trainer.environment_pool import EnvironmentPoolError, RayEnvironments

    def make_env():
        return ToolEnvironment([timed_pid], PLAIN, CalculatorTask().reward, ToolPolicy(timeout_s=5.0))

    pool = RayEnvironments(make_env, workers=2, tool_timeout_s=5.0)
    try:
        examples = [Example(f"q{i}", "", "t") for i in range(4)]
        assert pool.reset(examples) == ["q0", "q1", "q2", "q3"]
        steps = pool.step({i: "[timed_pid 0.5]" for i in range(4)})
        calls = {i: step.result.observation.split() for i, step in steps.items()}
        assert {pid for pid, _, _ in calls.values()} == {calls[0][0], calls[1][0]} != {str(os.getpid())}
        assert calls[0][0] == calls[2][0] != calls[1][0]  # trajectory i stays on worker i % 2
        assert float(calls[0][1]) < float(calls[1][2]) and float(calls[1][1]) < float(calls[0][2])  # overlapping
        assert steps[3].result.counts["call_ok"] == 1.0 and not steps[3].failed
    finally:
        pool.close()

    class Hanging:
        def reset(self, example):
            return example.prompt

        def step(self, action):
            time.sleep(60)

    hung = RayEnvironments(Hanging, workers=2, tool_timeout_s=0.1, margin_s=1.0)
    try:
        hung.reset(examples)
        with pytest.raises(EnvironmentPoolError, match=r"environment workers \[0, 1\] gave no step answer .*"
                                                       r"trajectories \[0, 1, 2, 3\]"):
            hung.step({0: "x", 1: "x", 2: "x", 3: "x"})
    finally:
        hung.close()


def test_a_feedback_environment_says_what_was_wrong_and_scores_a_later_solution_less():
    from hybridflow_lab.agents.feedback import FeedbackEnvironment
    from hybridflow_lab.tasks.sorting import SortingTask
    from hybridflow_lab.trainer.agent_rollout import rollout_metrics

    task = SortingTask(length=4, partial_credit="digits")
    env = FeedbackEnvironment(task, max_tries=3, retry_discount=0.5)
    example = Example("sort:3142=", "1234", "sorting")
    env.reset(example)
    wrong = env.step("1324")
    assert (wrong.observation, wrong.role, wrong.done, wrong.reward) == ("wrong at 2,3", "user", False, 0.0)
    assert env.step("123").observation == "wrong: 4 characters, not 3"
    solved = env.step("1234\n")  # the third try: 0.5 * 0.5 of the score
    assert solved.done and solved.reward == 0.25 and solved.counts["solved"] == 1.0
    env.reset(example)
    last = [env.step("1243") for _ in range(3)][-1]  # never solved: the last answer's partial credit
    assert last.done and last.reward == task.reward(example.prompt, "1243", "1234") and last.counts["solved"] == 0.0

    tokenizer = char_tokenizer()
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = [tokenizer.eos_token_id]
    other = Example("sort:9876=", "6789", "sorting")  # never solved by the scripted answers
    trajectories = run_episodes(Scripted([encode("1324") + eos, encode("1234") + eos, encode("1234") + eos]),
                                LocalEnvironments([FeedbackEnvironment(task, 3) for _ in range(2)]),
                                [example, other], encode, ObservationRenderer(tokenizer, PLAIN, chat=False),
                                AgentLimits(max_tokens=64))
    assert [len(t.turns) for t in trajectories] == [2, 3]  # each turn ended with EOS, and a user answered it
    assert trajectories[0].turns[0].observation == "wrong at 2,3"
    metrics = rollout_metrics(trajectories, Counter(), tools=False)
    assert metrics["agent/solved"] == 0.5 and metrics["agent/turns_to_solve"] == 2.0
    assert "agent/tool_use" not in metrics  # no tools: no tool metrics


def test_per_turn_credit_puts_each_turns_reward_on_its_last_policy_token_and_gae_credits_the_turns_apart():
    from hybridflow_lab.agents.trajectory import turn_level
    from hybridflow_lab.algorithms.advantages import gae

    tokenizer = char_tokenizer()
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    env = ToolEnvironment([calc], PLAIN, lambda prompt, answer, truth: 1.0 if answer == truth else 0.0)
    call, answer = encode("[calc 2*3]"), [*encode("6"), tokenizer.eos_token_id]
    [trajectory] = run_episodes(Scripted([call, answer]), LocalEnvironments([env]), [Example("2*3=", "6", "t")],
                                encode, ObservationRenderer(tokenizer, PLAIN, chat=False), AgentLimits(max_tokens=64))
    trajectory.turns[0].reward = 0.5  # a reward for the call itself, as a shaped environment might give
    tensors, columns = trajectories_batch([trajectory], tokenizer.pad_token_id)
    observed = len(encode(" -> 6\n"))
    ends = [len(call) - 1, len(call) + observed + len(answer) - 1]
    assert columns["turn_ends"] == [ends]
    rewards = turn_level(columns["turn_rewards"], columns["turn_ends"], tensors["responses"].shape[1])
    assert rewards[0].nonzero().flatten().tolist() == ends and rewards[0, ends].tolist() == [0.5, 1.0]
    mask = tensors["response_mask"]
    advantages, _ = gae(rewards, torch.zeros_like(rewards), mask, gamma=1.0, lam=1.0, whiten=False)
    # the call's tokens see both turns' rewards, the answer's tokens only the answer's
    assert advantages[0, 0] == pytest.approx(1.5) and advantages[0, ends[1]] == pytest.approx(1.0)


def test_retry_demonstrations_answer_wrong_then_right_after_the_feedback_each_answer_ending_with_eos():
    from hybridflow_lab.agents.feedback import RetryDemonstrations
    from hybridflow_lab.tasks.prompts import PromptFormat
    from hybridflow_lab.tasks.sorting import SortingTask
    from hybridflow_lab.trainer.sft import episode_batch

    task = RetryDemonstrations(SortingTask(length=4), share=0.5)
    examples = [task.sample(random.Random(i)) for i in range(40)]
    episodes = [task.episode(example) for example in examples]
    retried = [e for e in episodes if len(e) == 2]
    assert 10 <= len(retried) <= 30 and all(len(e) == 1 for e in episodes if e not in retried)  # about half
    (wrong, feedback), (right, done) = retried[0]
    assert wrong == right[1:] + right[:1] != right and feedback.startswith("wrong at") and done is None
    tokenizer = char_tokenizer()
    example = examples[episodes.index(retried[0])]
    batch = episode_batch(tokenizer, task, [example], PromptFormat(), PLAIN)
    trained = batch["responses"][0][batch["response_mask"][0].bool()].tolist()
    eos = tokenizer.eos_token_id
    assert trained == [*tokenizer(wrong, add_special_tokens=False)["input_ids"], eos,
                       *tokenizer(right, add_special_tokens=False)["input_ids"], eos]  # the feedback is context
    context = batch["responses"][0][~batch["response_mask"][0].bool() & batch["attention_mask"][0, -batch[
        "responses"].shape[1]:].bool()].tolist()
    assert tokenizer.decode(context) == f"\n{feedback}\n"  # rendered as the rollout renders a user's message


def test_calculator_demonstrations_call_calc_on_a_reasoning_gym_expression_in_the_runs_format_in_their_share():
    from hybridflow_lab.agents.calculator_demonstrations import CalculatorDemonstrations
    from hybridflow_lab.tasks import make_task

    products = make_task("reasoning_gym", dataset="products", options={"min_digits": 3, "max_digits": 3})
    task = CalculatorDemonstrations(products, HERMES, share=0.3)
    examples = [task.sample(random.Random(i)) for i in range(60)]
    episodes = [task.episode(example) for example in examples]
    calling = [e for e in episodes if len(e) == 2]
    assert 8 <= len(calling) <= 30 and all(len(e) == 1 for e in episodes if e not in calling)  # about 30%
    example = examples[episodes.index(calling[0])]
    (call_text, result), (answer, done) = calling[0]
    [call] = HERMES.calls(call_text)
    left, right = map(int, call.arguments["expression"].split("*"))
    assert call.name == "calc" and f"{left} * {right}" in example.prompt and result == str(left * right)
    assert answer == f"<answer>{left * right}</answer>" and done is None
    assert task.reward(example.prompt, answer, example.answer) == 1.0  # reasoning-gym's scorer agrees


@pytest.mark.parametrize("algorithm", [["algorithm.name=rloo"], ["algorithm.name=ppo"],
                                       ["algorithm.policy_loss=gspo"]], ids=["rloo", "ppo", "gspo"])
def test_each_algorithm_trains_on_trajectories_with_advantages_on_the_policys_tokens_only(tmp_path, algorithm):
    from hybridflow_lab.demos.warm_cache import cached_warm_start
    from hybridflow_lab.trainer.lab import Lab
    from tests.test_lab import local_overrides

    model_dir, _ = cached_warm_start("calculator", 0, 200)  # tutorial 13's: it calls the tool in some rollouts
    lab = Lab("calculator_grpo", overrides=local_overrides(model_dir, tmp_path / "run", "rollout.max_new_tokens=16",
                                                           *algorithm))
    try:
        metrics = lab.step()
        batch = lab.last_batch
        policy = batch["response_mask"].bool()
        real = batch["attention_mask"][:, batch["prompts"].shape[1]:].bool()
        assert (real & ~policy).any()  # some trajectories hold a tool's answer
        assert (batch["advantages"][~policy] == 0).all()  # observations and padding: no advantage, no gradient
        assert batch["advantages"][policy].abs().sum() > 0 and math.isfinite(metrics["actor/pg_loss"])
    finally:
        lab.shutdown()


def test_calculator_demonstrations_answer_at_once_where_the_calculator_cannot_read_the_expression():
    from hybridflow_lab.agents.calculator_demonstrations import CalculatorDemonstrations
    from hybridflow_lab.tasks import make_task

    arithmetic = make_task("reasoning_gym", dataset="basic_arithmetic")
    task = CalculatorDemonstrations(arithmetic, PLAIN, share=1.0)
    examples = [task.sample(random.Random(i)) for i in range(40)]
    unreadable = [e for e in examples if "-(" in arithmetic.expression(e).replace(" ", "")]
    assert unreadable and all(task.episode(e) == [(task.demonstration(e), None)] for e in unreadable)
    assert any(len(task.episode(e)) == 2 for e in examples)  # the others call the tool
