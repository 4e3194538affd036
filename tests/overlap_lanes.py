"""The ideal lanes of step 08's overlapped pair: how long its order leaves the compute waiting for the link.

    python tests/overlap_lanes.py STEP_DIR   ->  JSON: the order's exposed time, the sequential pair's, the target

Two lanes, as a GPU has them: compute, one node at a time, and the link, one all-to-all at a time in posting
order, each LINK long (as overlap.Link simulates --link-latency-ms). A node that reads an all-to-all waits for
it to arrive; that wait is exposed time. Posting costs nothing. The passes are simulated: generators that yield
the node names LayerNodes' passes yield, so the step's own interleave and pair_order decide the order, and the
sequential pair drives the forward to its end, then the backward. A pair is one forward and one backward of a
chunk of LAYERS layers. No model runs and no process group: it takes milliseconds.

The check of exercise 08.overlap: the step's order must expose at most TARGET. Megatron-LM's order exposes
nothing at these times; the sequential pair exposes each all-to-all whole.
"""
import json
import os
import sys

LAYERS, LINK = 2, 2.0
# A layer's node times, in units (about a millisecond). Attention's backward is twice its forward (input and
# weight gradients); the experts' backward is two nodes, input gradients then weight gradients (experts W); the
# combine's compute is the un-permutation (forward: in the next node that reads the combine).
TIMES = {("F", "attention"): 2.0, ("F", "experts"): 2.0, ("F", "combine"): 0.5,
         ("B", "combine"): 0.5, ("B", "experts"): 2.0, ("B", "experts W"): 2.0, ("B", "attention"): 4.0}
TARGET = LINK / 2  # exposed time allowed for the whole pair: half of one all-to-all


class Lanes:
    """The two lanes' clocks and boxes: (lane, label, start, end), lane "compute", "link" or "wait"."""

    def __init__(self, times, link):
        self.times, self.link = times, link
        self.now = self.link_free = 0.0
        self.arrivals, self.boxes = {}, []

    def compute(self, side, node, layer):
        end = self.now + self.times[side, node]
        self.boxes.append(("compute", f"{side}.{node} {layer}", self.now, end))
        self.now = end

    def post(self, side, node, layer):
        start = max(self.now, self.link_free)  # the link carries one all-to-all at a time
        self.link_free = start + self.link
        self.arrivals[side, node, layer] = self.link_free
        self.boxes.append(("link", f"{side}.{node} {layer}", start, self.link_free))

    def wait(self, side, node, layer):
        arrives = self.arrivals.pop((side, node, layer))
        if arrives > self.now:
            self.boxes.append(("wait", f"{side}.{node} {layer}", self.now, arrives))
            self.now = arrives

    def exposed(self):
        return sum(end - start for lane, _, start, end in self.boxes if lane == "wait")


def forward(lanes, layers):
    """LayerNodes.forward's nodes on the lanes: the combine's wait and un-permutation open the next node."""
    for layer in range(layers):
        if layer:
            lanes.wait("F", "combine", layer - 1)
            lanes.compute("F", "combine", layer - 1)
        lanes.compute("F", "attention", layer)
        yield "attention"
        lanes.post("F", "dispatch", layer)
        yield "dispatch"
        lanes.wait("F", "dispatch", layer)
        lanes.compute("F", "experts", layer)
        yield "experts"
        lanes.post("F", "combine", layer)
        yield "combine"
    lanes.wait("F", "combine", layers - 1)
    lanes.compute("F", "combine", layers - 1)


def backward(lanes, layers):
    """LayerNodes.backward's nodes on the lanes, last layer first."""
    for layer in reversed(range(layers)):
        lanes.compute("B", "combine", layer)
        lanes.post("B", "combine", layer)
        yield "combine"
        lanes.wait("B", "combine", layer)
        lanes.compute("B", "experts", layer)
        yield "experts"
        lanes.compute("B", "experts W", layer)
        yield "experts W"
        lanes.post("B", "dispatch", layer)
        yield "dispatch"
        lanes.wait("B", "dispatch", layer)
        lanes.compute("B", "attention", layer)
        yield "attention"


def pair_lanes(overlap, sequential=False, times=TIMES, link=LINK, layers=LAYERS):
    """One pair on the ideal lanes: the step's interleave (overlap, its module), or the sequential pair."""
    lanes = Lanes(times, link)
    if sequential:
        for _ in (*forward(lanes, layers), *backward(lanes, layers)):
            pass
    else:
        overlap.interleave(forward(lanes, layers), backward(lanes, layers))
    return lanes


def main(step_dir):
    sys.path.insert(0, os.path.abspath(step_dir))
    import overlap

    mine, sequential = pair_lanes(overlap), pair_lanes(overlap, sequential=True)
    waits = [f"{label} waited {end - start:g}" for lane, label, start, end in mine.boxes if lane == "wait"]
    print(json.dumps(dict(exposed=mine.exposed(), sequential=sequential.exposed(), target=TARGET, waits=waits,
                          order=overlap.pair_order(), pair=mine.now, compute=sum(TIMES.values()) * LAYERS)))


if __name__ == "__main__":
    main(*sys.argv[1:])
