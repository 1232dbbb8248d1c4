"""resolve_workflow: every accepted form, and a clear error for everything else."""

from __future__ import annotations

import pytest

from relayrl.client.session_client import SessionClient
from relayrl.errors import ConfigError
from relayrl.workflow import (
    AgentConfig,
    AgentWorkflow,
    GroupedWorkflow,
    RolloutWorkflow,
    import_dotted,
    resolve_workflow,
)
from tests.workflow.agents import ChatAgent, SyncEnvAgent
from tests.workflow.helpers import LengthWorkflow

GATEWAY = SessionClient("http://127.0.0.1:9", admin_key="k")


def test_an_instance_is_used_as_is() -> None:
    wf = LengthWorkflow()
    assert resolve_workflow(wf) is wf


def test_a_class_is_built_with_the_kwargs() -> None:
    wf = resolve_workflow(LengthWorkflow, {"delay_s": 0.5})
    assert isinstance(wf, LengthWorkflow) and wf.delay_s == 0.5


def test_a_dotted_path_names_a_class_or_an_agent() -> None:
    wf = resolve_workflow("tests.workflow.helpers.LengthWorkflow", {"delay_s": 0.25})
    assert isinstance(wf, LengthWorkflow) and wf.delay_s == 0.25
    wf = resolve_workflow("tests.workflow.agents:ChatAgent", {"model": "m"}, gateway=GATEWAY)
    assert isinstance(wf, AgentWorkflow) and wf.agent.model == "m"
    assert import_dotted("tests.workflow.helpers.make_td").__name__ == "make_td"


def test_an_agent_is_wrapped_with_the_gateway_and_its_config() -> None:
    agent = ChatAgent()
    wf = resolve_workflow(agent, gateway=GATEWAY, agent_config=AgentConfig(discount=0.5))
    assert isinstance(wf, AgentWorkflow)
    assert wf.agent is agent and wf.client is GATEWAY and wf.config.discount == 0.5


def test_group_size_above_one_wraps_in_a_group() -> None:
    wf = resolve_workflow(LengthWorkflow, group_size=4)
    assert isinstance(wf, GroupedWorkflow) and wf.group_size == 4
    assert isinstance(wf.workflow, LengthWorkflow)
    assert resolve_workflow(wf, group_size=4) is wf


@pytest.mark.parametrize(
    ("workflow", "kwargs", "says"),
    [
        ("no_such_module_xyz.Agent", None, "cannot import module 'no_such_module_xyz'"),
        ("tests.workflow.helpers.NoSuchThing", None, "has no 'NoSuchThing'"),
        ("justaname", None, "not of the form 'module.Name'"),
        ("tests.workflow.helpers.make_td", None, "needs a gateway"),  # a function: an agent
        (42, None, "cannot use a int"),
        (dict, None, "neither a RolloutWorkflow nor an agent"),
        (LengthWorkflow(), {"delay_s": 1}, "pass the class"),
        (LengthWorkflow, {"nope": 1}, "cannot build LengthWorkflow"),
        (ChatAgent(), None, "needs a gateway"),
    ],
)
def test_what_fits_no_form_is_refused_with_what_was_expected(workflow, kwargs, says) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_workflow(workflow, kwargs)
    assert says in str(err.value)


def test_the_error_for_an_unusable_object_lists_the_accepted_forms() -> None:
    with pytest.raises(ConfigError, match=r"RolloutWorkflow instance.*dotted path.*run"):
        resolve_workflow(object())


def test_a_synchronous_agent_needs_subprocess_mode() -> None:
    with pytest.raises(ConfigError, match="mode='subprocess'"):
        resolve_workflow(SyncEnvAgent(), gateway=GATEWAY)
    wf = resolve_workflow(SyncEnvAgent(), gateway=GATEWAY,
                          agent_config=AgentConfig(mode="subprocess"))
    assert isinstance(wf, RolloutWorkflow)


def test_an_unknown_mode_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="'thread'"):
        AgentConfig(mode="thread")
