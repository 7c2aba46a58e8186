"""Lesson 11: rank clocks, the timeline a cluster would show, from a run on a laptop.

    tpedu.comm.recorder   (below, in comm) every launched rank logs its spans in order: compute
                          (wall and thread CPU time) between communication calls, and each call
                          as issued (op, group, bytes, peer, blocking or asynchronous, when it
                          was waited on); tpedu.comm.collectives feeds it
    links                 the α-β links a replay prices communication on: measured loopback,
                          NVLink, PCIe, InfiniBand (the cluster what-if's presets), free
    replay                the ranks' logs replayed as if each rank had its own device: step
                          time, bubble, exposed and hidden communication
    trace                 the recorded and the replayed timelines as a Chrome trace / Perfetto
                          JSON file (`tpedu train --trace FILE`)
    events                a pipeline step's recorded or replayed timeline as the Events that
                          tpedu.parallel.pipeline.schedules draws and measures the bubble of

On a 2-core laptop 4 ranks share 2 cores: a rank's wall clock includes the other ranks' turns,
but its CPU time does not. Every rank's work is real and exact; only the clock is shared, and
the replay gives each rank its own.
"""
