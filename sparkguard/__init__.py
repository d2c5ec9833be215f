"""sparkguard: memory-safety daemon for unified-memory GPU inference boxes.

On a DGX Spark (GB10) the GPU allocates from system RAM; when MemAvailable runs out
the kernel tends to livelock in reclaim instead of OOM-killing.  sparkguard watches
/proc/meminfo and SIGTERMs the inference engine (then SIGKILLs its whole tree after a
grace period) before that happens.
"""

__version__ = "0.1.0"
