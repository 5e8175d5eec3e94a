# The C declarations every engine kernel shares: the segment's layout (_layout.h) and the one
# wait loop with its atomics and futexes (_sync.h). Included textually by _segment.pyx,
# _slots.pyx and _ring.pyx, so each declares nothing of the segment on its own.

from libc.stdint cimport int32_t, uint8_t, uint32_t, uint64_t

# the statuses every wait and step returns: the door's (ferro/engine.h)
from ferro.engine cimport FERRO_FAILED, FERRO_MISMATCH, FERRO_OK, FERRO_TIMEOUT

cdef extern from "_layout.h" nogil:
    uint32_t FERRO_MAGIC
    uint32_t FERRO_SEGMENT_VERSION
    uint32_t FERRO_HEADER_ROOM
    int FERRO_PAD
    int FERRO_EAGER
    int FERRO_CHUNK
    int FERRO_CMA

    ctypedef struct ferro_seg_head:
        uint32_t magic, version, nranks
        uint64_t slot_bytes, ring_bytes, split_bytes
        double link_rtt_ns, link_copy_gbps, link_at
        uint32_t probes

    ctypedef struct ferro_ctrl:
        uint32_t step, sleepers
        uint64_t pid, probe
        uint32_t bell

    ctypedef struct ferro_slot_head:
        uint8_t header[128]
        uint64_t pid, in_addr, out_addr

    ctypedef struct ferro_ring_ctrl:
        uint32_t head, head_sleepers, tail, tail_sleepers

    ctypedef struct ferro_ring_entry:
        uint32_t kind, len
        uint64_t tag, total, aux

    ctypedef struct ferro_layout:
        int nranks
        size_t slot_bytes, ring_bytes
        size_t ctrl_off, slot_off, slot_stride, parity_stride, ring_off, ring_stride
        size_t door_ring_off, size

    void ferro_layout_init(ferro_layout* L, int n, size_t slot_bytes, size_t ring_bytes)
    ferro_seg_head* ferro_head_of(unsigned char* base)
    ferro_ctrl* ferro_ctrl_of(unsigned char* base, const ferro_layout* L, int rank)
    ferro_slot_head* ferro_slot_of(unsigned char* base, const ferro_layout* L, int rank,
                                   uint32_t step)
    unsigned char* ferro_slot_data(ferro_slot_head* slot)
    ferro_ring_ctrl* ferro_ring_of(unsigned char* base, const ferro_layout* L, int src, int dst)
    unsigned char* ferro_ring_data(ferro_ring_ctrl* ring)

cdef extern from "_sync.h" nogil:
    double FERRO_SLICE
    int FERRO_UNTIL_CHANGED
    int FERRO_UNTIL_REACHED

    ctypedef struct ferro_policy:
        int spin, yields

    uint32_t ferro_load(const uint32_t* p)
    void ferro_store(uint32_t* p, uint32_t v)
    void ferro_add(uint32_t* p, int32_t v)
    double ferro_now()
    void ferro_futex_wait(uint32_t* word, uint32_t seen, double seconds)
    void ferro_futex_wake(uint32_t* word)
    void ferro_publish(uint32_t* word, uint32_t v, const uint32_t* sleepers)
    int ferro_wait(const ferro_policy* pol, uint32_t* word, uint32_t target, int mode,
                   uint32_t* sleepers, double deadline, const uint32_t* failed, uint32_t* bell,
                   double busy_until)
