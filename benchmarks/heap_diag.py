"""What holds glibc's brk heap resident after a load: a diagnostic that
``benchmarks/load.py`` runs inside the server process when ``DUPLEXKIT_LOAD_DIAG=DIR`` is set.

Linux x86-64 with glibc only, and meant for a server on ``PYTHONMALLOC=malloc`` (every Python object
is then a malloc chunk). At the baseline and after the load it writes ``malloc_info-N.xml`` (glibc's
``malloc_info(3)``: per-arena free chunks, system bytes, mmapped chunks) and ``heap-N.txt``:

* the main arena's heap (the ``[heap]`` mapping) walked chunk by chunk from its start: each chunk's
  size is the word at +8 (low 3 bits are flags), a chunk is in use when the next chunk's PREV_INUSE
  bit (bit 0 of its size word) is set (glibc ``malloc/malloc.c``, "Chunk representations"); fastbin
  and tcache chunks count as in use (``malloc_trim`` consolidates fastbins first; tcache holds at most
  7 chunks per size class per thread);
* which 4 KiB pages are resident (``/proc/self/pagemap``: bit 63 "page present", readable without
  privileges; Documentation/admin-guide/mm/pagemap.rst);
* after the load: the in-use chunks on pages that are resident now but were not at the baseline (the
  pages a load left pinned), by type when the chunk holds a Python object (its ``ob_type`` word, at
  +8 of the object, is the address of a known type; the object starts 0, 16 or 32 bytes into the
  chunk: a GC header and the managed-dict pre-header precede it), else by chunk size; with examples
  and, when ``DUPLEXKIT_LOAD_TRACEMALLOC`` is also set, where they were allocated.
"""

from __future__ import annotations

import array
import bisect
import collections
import ctypes
import ctypes.util
import gc
import re
import sys
import tracemalloc
from pathlib import Path

PAGE = 4096
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
_libc.fopen.restype = ctypes.c_void_p
_libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
_libc.fclose.argtypes = [ctypes.c_void_p]
_libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
_libc.sbrk.restype = ctypes.c_size_t
_libc.sbrk.argtypes = [ctypes.c_ssize_t]


def malloc_info(path: Path) -> None:
    fp = _libc.fopen(str(path).encode(), b"w")
    if not fp:
        raise OSError(f"cannot open {path} for writing")
    try:
        _libc.malloc_info(0, fp)
    finally:
        _libc.fclose(fp)


def heap_range() -> tuple[int, int]:
    """The main heap's [start, end): ``start_brk`` (field 47 of ``/proc/self/stat``, proc(5)) and the
    current break (``sbrk(0)``); read with as few allocations as possible (they would land in the heap
    being looked at)."""
    with open("/proc/self/stat", "rb") as f:
        stat = f.read()
    lo = int(stat[stat.rindex(b")") + 2:].split()[47 - 3])
    return lo, _libc.sbrk(0)


def resident_pages(lo: int, hi: int) -> bytearray:
    """One byte per page of [lo, hi): 1 when present in RAM."""
    n = (hi - lo) // PAGE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(lo // PAGE * 8)
        raw = array.array("Q", f.read(n * 8))
    return bytearray(1 if (e >> 63) & 1 else 0 for e in raw)


def walk(lo: int, hi: int) -> array.array:
    """In-use chunks of the main heap as a flat array (addr, size, addr, size, ...) and, at the end,
    the counts of free chunks and free bytes."""
    out = array.array("Q")
    word = ctypes.c_size_t.from_address
    p = lo
    nfree = free_bytes = 0
    while p + 16 <= hi:
        size = word(p + 8).value & ~7
        if size < 32 or p + size > hi:
            break
        nxt = p + size
        if nxt + 16 > hi:  # the top chunk
            break
        if word(nxt + 8).value & 1:
            out.append(p)
            out.append(size)
        else:
            nfree += 1
            free_bytes += size
        p = nxt
    out.append(nfree)
    out.append(free_bytes)
    return out


def tcache_key(lo: int):
    """The key glibc (>= 2.34) writes at +8 of every chunk it keeps in a thread's tcache, read from the
    main thread's cache: the first chunk of the main heap is its ``tcache_perthread_struct`` (656 bytes:
    ``uint16_t counts[64]`` then ``tcache_entry *entries[64]``; malloc.c). None when the caches are empty."""
    word = ctypes.c_size_t.from_address
    if word(lo + 8).value & ~7 != 0x290:
        return None
    for i in range(64):
        if ctypes.c_uint16.from_address(lo + 16 + 2 * i).value:
            e = word(lo + 16 + 128 + 8 * i).value
            if e:
                return word(e + 8).value
    return None


def numpy_cached_blocks() -> set:
    """Addresses of the free blocks numpy keeps in its small-block caches (``datacache``: up to 7 blocks
    for each size below 1024 bytes; ``dimcache``: shapes/strides; numpy/_core/src/multiarray/alloc.c,
    ``cache_bucket {npy_uintp available; void *ptrs[7];}``), read through the static symbols of
    ``_multiarray_umath`` (``nm``); empty when numpy is not loaded or the symbols are stripped."""
    import subprocess

    mod = sys.modules.get("numpy._core._multiarray_umath")
    if mod is None:
        return set()
    path = mod.__file__
    try:
        syms = subprocess.run(["nm", path], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    base = None
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[5] == path and int(parts[2], 16) == 0:
            base = int(parts[0].split("-")[0], 16)
            break
    if base is None:
        return set()
    out = set()
    for line in syms.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] in ("datacache", "dimcache"):
            n = 1024 if parts[2] == "datacache" else 16
            addr = base + int(parts[0], 16)
            for b in range(n):
                avail = ctypes.c_size_t.from_address(addr + 64 * b).value
                for k in range(min(avail, 7)):
                    out.add(ctypes.c_size_t.from_address(addr + 64 * b + 8 + 8 * k).value)
    return out


def _all_types() -> dict:
    seen: dict = {}
    stack = [object]
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen[id(t)] = t
        try:
            stack.extend(type.__subclasses__(t))
        except TypeError:
            pass
    return seen


def _object_at(mem: int, size: int, types: dict):
    """(type, address) of the Python object in a chunk's user memory, or None."""
    word = ctypes.c_ssize_t.from_address
    for off in (0, 16, 32):
        if off + 16 > size - 8:
            break
        refcnt, tp = word(mem + off).value, ctypes.c_size_t.from_address(mem + off + 8).value
        t = types.get(tp)
        if t is not None and 0 < refcnt < 1 << 32:  # (compact str objects are smaller than str's basicsize)
            return t, mem + off
    return None


_MANAGED_DICT = 1 << 4  # Py_TPFLAGS_MANAGED_DICT (CPython 3.11 Include/object.h)


def buffers_of(o) -> list:
    """Addresses of the separately allocated storage of a container (CPython 3.11 layouts,
    Include/cpython/listobject.h, dictobject.h, setobject.h, bytearrayobject.h, Modules/_collectionsmodule.c):
    a list's item array, a dict's keys and values tables, a set's hash table, a bytearray's bytes, a
    deque's blocks, an object's managed-dict values."""
    word = lambda a: ctypes.c_size_t.from_address(a).value  # noqa: E731
    a, out = id(o), []
    if isinstance(o, list):
        out.append(word(a + 24))
    elif isinstance(o, dict):
        out += [word(a + 32), word(a + 40)]
    elif isinstance(o, (set, frozenset)):
        out.append(word(a + 40))
    elif isinstance(o, bytearray):
        out.append(word(a + 32))
    elif isinstance(o, collections.deque):
        b, right = word(a + 24), word(a + 32)
        for _ in range(100000):
            out.append(b)
            if not b or b == right:
                break
            b = word(b + 8 + 64 * 8)
        out += [word(a + 80 + 8 * i) for i in range(min(16, word(a + 72)))]
    if type(o).__flags__ & _MANAGED_DICT:
        out.append(word(a - 32))
    return [x for x in out if x]


class HeapDiag:
    def __init__(self, directory: str) -> None:
        self.dir = Path(directory)
        self.n = 0
        self.base_lo = self.base_hi = 0
        self.base_res = bytearray()

    def snapshot(self) -> None:
        """Report ``heap-N.txt`` and ``malloc_info-N.xml``. The first call (the baseline) only records
        which pages are resident (milliseconds: it runs on the event loop at the start of the measured
        load); the chunk walk, seconds on a large heap, runs on later calls."""
        self.n += 1
        lo, hi = heap_range()
        res = resident_pages(lo, hi)
        head = f"heap {lo:#x}-{hi:#x}: {(hi - lo) / 2**20:.1f} MiB mapped, {sum(res) * PAGE / 2**20:.1f} MiB resident"
        if self.n == 1:
            malloc_info(self.dir / f"malloc_info-{self.n}.xml")
            self.base_lo, self.base_hi, self.base_res = lo, hi, res
            (self.dir / f"heap-{self.n}.txt").write_text(head + "\n")
            return
        chunks = walk(lo, hi)
        malloc_info(self.dir / f"malloc_info-{self.n}.xml")
        nfree, free_bytes = chunks[-2], chunks[-1]
        used = sum(chunks[1:-2:2])
        lines = [f"{head}; in use {(len(chunks) - 2) // 2} chunks {used / 2**20:.1f} MiB; free {nfree} chunks "
                 f"{free_bytes / 2**20:.1f} MiB"]
        lines += self._pinned(lo, hi, res, chunks)
        (self.dir / f"heap-{self.n}.txt").write_text("\n".join(lines) + "\n")

    def _pinned(self, lo: int, hi: int, res: bytearray, chunks: array.array) -> list:
        def was_resident(page_addr: int) -> bool:
            i = (page_addr - self.base_lo) // PAGE
            return 0 <= i < len(self.base_res) and self.base_res[i] == 1

        new_pages = {lo + i * PAGE for i, r in enumerate(res) if r and not was_resident(lo + i * PAGE)}
        lost = sum(1 for i, r in enumerate(self.base_res) if r and (
            not (lo <= self.base_lo + i * PAGE < hi) or not res[(self.base_lo + i * PAGE - lo) // PAGE]))
        above = sum(1 for p in new_pages if p >= self.base_hi)
        out = [f"baseline heap ended at {self.base_hi:#x}; pages resident now, not at the baseline: {len(new_pages)} "
               f"({len(new_pages) * PAGE / 2**20:.1f} MiB; {above} of them above the baseline's end); resident at "
               f"the baseline, not now: {lost} ({lost * PAGE / 2**20:.1f} MiB)"]
        types = _all_types()
        # objects known alive (reached by the collector): only these are looked at (a chunk in tcache or
        # a fastbin counts as in use but holds a dead object)
        live, owner = set(), {}
        for o in gc.get_objects():
            for x in (o, *gc.get_referents(o)):
                if id(x) not in live:
                    live.add(id(x))
                    for b in buffers_of(x):
                        owner[b] = x
        starts = sorted(owner)
        tally, nbytes, examples = collections.Counter(), collections.Counter(), {}
        pages_of = collections.defaultdict(set)
        pinning_pages, peeks = set(), collections.defaultdict(list)
        npcache = numpy_cached_blocks()
        out.append(f"blocks in numpy's small-block caches: {len(npcache)}")
        key_word = tcache_key(lo)
        out.append(f"tcache key: {key_word:#x}" if key_word is not None else "tcache key: not found")
        for i in range(0, len(chunks) - 2, 2):
            p, size = chunks[i], chunks[i + 1]
            first, last = p // PAGE * PAGE, (p + size - 1) // PAGE * PAGE
            touched = [pg for pg in range(first, last + 1, PAGE) if pg in new_pages]
            if not touched:
                continue
            pinning_pages.update(touched)
            found = _object_at(p + 16, size, types)
            if p + 16 in npcache:
                key = f"free, in numpy's small-block cache ({1 << (size - 1).bit_length()} B class)"
            elif key_word is not None and size <= 1040 and ctypes.c_size_t.from_address(p + 24).value == key_word:
                key = f"free, in a tcache ({1 << (size - 1).bit_length()} B class)"
            elif found is not None:
                key = f"{found[0].__module__}.{found[0].__qualname__}"
                if found[1] not in live:
                    key += " (not reached from the collector's objects)"
                elif key not in examples:
                    examples[key] = found[1]
            else:
                j = bisect.bisect_left(starts, p + 16)
                o = owner[starts[j]] if j < len(starts) and starts[j] < p + size else None
                if o is not None:
                    key = f"storage of a {type(o).__module__}.{type(o).__qualname__}"
                    if key not in examples:
                        examples[key] = id(o)
                else:
                    key = f"raw chunk {1 << (size - 1).bit_length()} B class"
            if key not in examples and len(peeks[key]) < 4:  # printable text in the chunk, read raw
                if found is not None and found[0] is str:  # compact ASCII: length at +16, text at +48 (3.11)
                    n = ctypes.c_ssize_t.from_address(found[1] + 16).value
                    raw = ctypes.string_at(found[1] + 48, max(0, min(n, 60, p + size - found[1] - 48)))
                else:
                    raw = ctypes.string_at(p + 16, min(size - 16, 128))
                text = re.findall(rb"[ -~]{3,}", raw)
                if text:
                    peeks[key].append(b"|".join(text)[:60].decode())
            tally[key] += 1
            nbytes[key] += size
            pages_of[key].update(touched)
        out.append(f"in-use chunks on those pages: {sum(tally.values())} ({sum(nbytes.values()) / 2**20:.2f} MiB), "
                   f"on {len(pinning_pages)} of the {len(new_pages)} pages (the rest: free-chunk headers)")
        for key, n in tally.most_common(40):
            line = f"  {n:7d} chunks {nbytes[key] / 1024:9.1f} KiB on {len(pages_of[key]):5d} pages  {key}"
            if key in examples:
                obj = ctypes.cast(examples[key], ctypes.py_object).value
                line += f"  e.g. {repr(obj)[:140]!s}"
                if tracemalloc.is_tracing():
                    tb = tracemalloc.get_object_traceback(obj)
                    if tb is not None:
                        line += "\n" + "\n".join("        " + l for l in tb.format(limit=8, most_recent_first=True))
                del obj
            elif peeks.get(key):
                line += "  text: " + " ; ".join(map(repr, peeks[key]))
            out.append(line)
        del live, owner, starts
        gc.collect()
        return out


if __name__ == "__main__" and (len(sys.argv) != 2 or sys.argv[1].startswith("-")):
    print("usage: python benchmarks/heap_diag.py DIR   (a self-check: two heap snapshots of this process "
          "into DIR, then prints the second; benchmarks/load.py uses the module with DUPLEXKIT_LOAD_DIAG)")
    sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
if __name__ == "__main__":
    Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
    d = HeapDiag(sys.argv[1])
    d.snapshot()
    keep = [bytes(64) + str(i).encode() for i in range(20000)]
    junk = [bytes(3000) for _ in range(20000)]
    keep2 = [str(i) * 3 for i in range(0, 20000, 50)]
    del junk
    _libc.malloc_trim(0)
    d.snapshot()
    print(Path(sys.argv[1], "heap-2.txt").read_text())
