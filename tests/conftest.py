"""Shared fixtures."""

import pytest
from flwr.supercore.task_identity import TaskIdentity


@pytest.fixture(autouse=True)
def task_identity():
    """Flower Messages need a run/task identity, which a Flower process sets; restore it afterwards."""
    saved = (TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id)
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1
    yield
    TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id = saved


class FakeGrid:
    """The part of a Flower Grid that strategies' configure_* calls use: the connected node ids."""

    def __init__(self, node_ids):
        self.node_ids = node_ids

    def get_node_ids(self):
        return self.node_ids
