"""hpc_cli.model.staging: the ring of pinned host buffers that carries a step's small inputs to
the device, reused, never written while a copy that reads it is still queued."""

from __future__ import annotations

import pytest
import torch

from hpc_cli.model.staging import RING, HostStaging


def test_staged_values_reach_the_device_and_a_cpu_send_is_a_copy():
    st = HostStaging(torch.device("cpu"))
    a = st.stage([1, 2, 3])
    assert a.dtype == torch.int64 and a.tolist() == [1, 2, 3]
    sent = st.send(a)
    for i in range(RING):  # the ring comes back to a's buffer and writes it again
        st.stage([10 + i] * 3)
    assert sent.tolist() == [1, 2, 3]
    dst = torch.zeros(3, dtype=torch.int64)
    st.send_into(st.stage([7, 8, 9]), dst)
    assert dst.tolist() == [7, 8, 9]


def test_a_buffer_grows_to_the_values_it_is_given():
    st = HostStaging(torch.device("cpu"), ring=1)
    assert st.stage(list(range(5))).tolist() == list(range(5))
    big = list(range(1000))
    assert st.stage(big).tolist() == big
    assert st.stage([4]).tolist() == [4]


@pytest.mark.gpu
def test_a_buffer_is_not_written_while_its_copy_waits_behind_device_work():
    """The copies queue behind a kernel that keeps the device busy; the ring comes back to the
    first buffer before they run. Without the wait on the buffer's event the first copy would
    read the later values."""
    dev = torch.device("cuda")
    st = HostStaging(dev)
    dsts = [torch.zeros(256, dtype=torch.int64, device=dev) for _ in range(2 * RING + 1)]
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # a few tenths of a second of device time ahead of the copies
    for i, dst in enumerate(dsts):
        st.send_into(st.stage([i] * 256), dst)
    sent = st.send(st.stage([99] * 256))
    torch.cuda.synchronize()
    for i, dst in enumerate(dsts):
        assert dst.tolist() == [i] * 256, f"copy {i} read a buffer written again"
    assert sent.tolist() == [99] * 256
