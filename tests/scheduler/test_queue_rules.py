from scheduler_svc.core import RequestStatus
from scheduler_svc.core.queues import FCFSQueue, PriorityQueue, make_queue
from tests.scheduler.helpers import make_request


def ids(queue):
    return [r.req_id for r in queue]


def test_fcfs_is_arrival_order_and_a_preempted_request_goes_back_to_the_front():
    q = FCFSQueue()
    for name in "abc":
        q.add(make_request(name, 2))
    first = q.pop()
    q.prepend(first)
    assert ids(q) == ["a", "b", "c"]
    q.prepend_all([q.pop(), q.pop()])
    assert ids(q) == ["a", "b", "c"]


def test_priority_is_lower_value_first_then_earlier_arrival_and_preempted_keeps_its_place():
    q = make_queue("priority")
    assert isinstance(q, PriorityQueue)
    q.add(make_request("late_hi", 2, priority=0, arrival=5.0))
    q.add(make_request("early_lo", 2, priority=1, arrival=0.0))
    q.add(make_request("early_hi", 2, priority=0, arrival=1.0))
    assert ids(q) == ["early_hi", "late_hi", "early_lo"]
    head = q.pop()
    q.prepend(head)
    assert q.peek() is head


def test_removal_is_lazy_and_the_count_is_exact():
    for q in (FCFSQueue(), PriorityQueue()):
        reqs = [make_request(name, 2) for name in "abc"]
        for r in reqs:
            q.add(r)
        reqs[0].status = RequestStatus.FINISHED_ABORTED
        q.discard(reqs[0])
        reqs[1].status = RequestStatus.FINISHED_ABORTED
        q.discard(reqs[1])
        assert len(q) == 1 and ids(q) == ["c"]
        assert q.pop() is reqs[2] and len(q) == 0 and q.peek() is None
