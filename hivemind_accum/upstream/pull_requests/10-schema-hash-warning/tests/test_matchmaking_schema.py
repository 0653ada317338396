import logging
from collections import Counter

import pytest
import torch

from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.partition import AllreduceException


@pytest.mark.forked
def test_bad_schema_hash_is_a_warning(tmp_path):
    # the averagers log in their own processes: a handler added before they start is inherited by them
    log_file = tmp_path / "matchmaking.log"
    handler = logging.FileHandler(log_file)
    handler.setFormatter(logging.Formatter("%(process)d %(levelno)d %(message)s"))
    matchmaking_logger = logging.getLogger("hivemind.averaging.matchmaking")
    matchmaking_logger.addHandler(handler)

    dht1 = DHT(start=True)
    dht2 = DHT(start=True, initial_peers=dht1.get_visible_maddrs())
    averagers = [
        DecentralizedAverager(
            [torch.zeros(4, dtype=dtype)],
            dht=dht,
            prefix="test",
            target_group_size=2,
            min_matchmaking_time=1.0,
            request_timeout=0.5,
            start=True,
        )
        for dht, dtype in ((dht1, torch.float32), (dht2, torch.float16))
    ]
    assert averagers[0].schema_hash != averagers[1].schema_hash

    rounds = 0
    while "will not average with this peer" not in log_file.read_text() and rounds < 5:
        controls = [averager.step(wait=False, timeout=3) for averager in averagers]
        for control in controls:
            with pytest.raises(AllreduceException):  # the two never form a group
                control.result(timeout=30)
        rounds += 1
    for _ in range(2):  # more rounds, more rejections: each averager still warns once
        controls = [averager.step(wait=False, timeout=3) for averager in averagers]
        for control in controls:
            with pytest.raises(AllreduceException):
                control.result(timeout=30)

    for averager in averagers:
        averager.shutdown()
    dht1.shutdown()
    dht2.shutdown()
    matchmaking_logger.removeHandler(handler)
    handler.close()

    lines = [line for line in log_file.read_text().splitlines() if "will not average with this peer" in line]
    assert lines, f"no rejection for the schema hash logged in {rounds} rounds"
    assert all(int(line.split()[1]) == logging.WARNING for line in lines), lines
    assert set(Counter(line.split()[0] for line in lines).values()) == {1}, lines  # once per averager process
