/*
 * memtouch - memory writer and verifier: the correctness oracle for
 * snapshot/restore of a guest's RAM.
 *
 *   memtouch -m MIB [-r PAGES_PER_SEC] [-H HOT_MIB] [-i REPORT_SECS] [-V VERIFY_PAGES_PER_SEC]
 *            [-n NICE] [-X N] [-W] [-P]
 *
 * Allocates MIB MiB (mlock'ed if possible) and fills every 4 KiB page with
 * a pattern that can be checked on its own:
 *
 *   bytes 0..31   header: magic "VMCSNAP!", page index, generation, ~generation
 *   bytes 32..    508 64-bit words of an LCG stream seeded from (index, generation)
 *
 * The generation each page should hold is kept in a small array (4 bytes per
 * page). The main loop forever
 *   - rewrites randomly chosen pages at -r pages/s with generation+1
 *     (within the first -H MiB only, when given: a hot working set);
 *   - verifies pages in order (header and body) against the array,
 *     continuously, or at -V pages/s when given.
 * A page whose content does not match is reported as MEMTOUCH-CORRUPTION
 * (at most 10 lines per report interval), counted in errors=, and rewritten
 * so that one bad page is counted once. It runs at nice 19 (-n) so that the
 * continuous verification only uses CPU time nothing else in the guest wants.
 *
 * With -W (read-only) the pages are filled once and then only verified,
 * never written again (no rewrites, and a bad page is reported but not
 * repaired, so it is reported again at each sweep): a guest that reads its
 * memory without dirtying it. With -P, after the fill, the buffer's
 * physical page frames (from /proc/self/pagemap, root only) are printed as
 * ranges, so that a host can tell which guest-physical pages it holds:
 *
 *   memtouch: pfns first=<pfn> count=<pages>      (one line per range)
 *   memtouch: pfns total=<pages> ranges=<n> unknown=<pages without a pfn>
 *
 * A report line every -i seconds:
 *   memtouch: t=<s> writes=<total> writes_per_s=<n> verified=<total> errors=<n> sweeps=<n>
 * (sweeps = complete verification passes over all pages).
 */
#include "common.h"

#include <getopt.h>
#include <sys/mman.h>
#include <sys/resource.h>

#define PAGE_SIZE 4096u
#define WORDS_PER_PAGE (PAGE_SIZE / 8u)
#define HDR_WORDS 4u
#define BODY_WORDS (WORDS_PER_PAGE - HDR_WORDS)
#define MAGIC 0x2150414E53434D56ULL /* "VMCSNAP!" little-endian */
#define DEFAULT_RATE 1024u          /* pages/s = 4 MiB/s: easy for TCG */
#define CHUNK 64u                   /* pages per step between clock reads */
#define MAX_CORRUPTION_LINES 10u

static uint8_t *mem;
static uint32_t *expected_gen;
static uint64_t npages;

static void usage(void)
{
    fprintf(stderr,
            "usage: memtouch -m MIB [-r PAGES_PER_SEC] [-H HOT_MIB] [-i REPORT_SECS]"
            " [-V VERIFY_PAGES_PER_SEC] [-n NICE] [-W] [-P]\n"
            "  -m MIB      memory to allocate and check (required, > 0)\n"
            "  -r N        pages rewritten per second (default %u; 0 = as fast as possible)\n"
            "  -H MIB      rewrite only the first MIB (hot working set; default: all)\n"
            "  -i SECS     seconds between report lines (default 1)\n"
            "  -V N        pages verified per second (default 0 = continuously)\n"
            "  -n NICE     scheduling niceness, 0..19 (default 19: the verifier soaks up\n"
            "              idle CPU without starving other programs of the guest)\n"
            "  -X N        self-test: corrupt N random pages after the first report\n"
            "              (the checker reports each one unless the writer rewrites it first)\n"
            "  -W          read-only: fill once, then only verify (no rewrites, no repairs)\n"
            "  -P          print the buffer's physical page frame ranges after the fill (root)\n",
            DEFAULT_RATE);
    exit(2);
}

static inline uint64_t lcg_seed(uint64_t index, uint64_t gen)
{
    return (index + 1) * 0x9E3779B97F4A7C15ULL ^ (gen + 1) * 0xC2B2AE3D27D4EB4FULL;
}

/* One step of a 64-bit LCG, output mixed so low bits are not periodic. */
#define LCG_STEP(x) ((x) = (x) * 6364136223846793005ULL + 1442695040888963407ULL)
#define LCG_OUT(x) ((x) ^ ((x) >> 29))

static void fill_page(uint64_t index, uint32_t gen)
{
    uint64_t *w = (uint64_t *)(mem + index * PAGE_SIZE);
    w[0] = MAGIC;
    w[1] = index;
    w[2] = gen;
    w[3] = ~(uint64_t)gen;
    uint64_t x = lcg_seed(index, gen);
    for (unsigned j = 0; j < BODY_WORDS; j++) {
        LCG_STEP(x);
        w[HDR_WORDS + j] = LCG_OUT(x);
    }
}

static uint64_t errors;
static unsigned lines_this_interval;
static uint64_t suppressed;

static void report_corruption(uint64_t index, uint32_t gen, const uint64_t *w, int word,
                              uint64_t want, uint64_t got)
{
    errors++;
    if (lines_this_interval >= MAX_CORRUPTION_LINES) {
        suppressed++;
        return;
    }
    lines_this_interval++;
    printf("MEMTOUCH-CORRUPTION page=%" PRIu64 " expected_gen=%" PRIu32 " found_gen=%" PRIu64
           " found_magic=0x%016" PRIx64 " found_index=%" PRIu64 " word=%d expected=0x%016" PRIx64
           " found=0x%016" PRIx64 "\n",
           index, gen, w[2], w[0], w[1], word, want, got);
}

static int read_only;

/* Verify one page; returns 1 if it was corrupt (and has been repaired,
 * unless read-only). */
static int verify_page(uint64_t index)
{
    const uint64_t *w = (const uint64_t *)(mem + index * PAGE_SIZE);
    uint32_t gen = expected_gen[index];
    uint64_t hdr[HDR_WORDS] = { MAGIC, index, gen, ~(uint64_t)gen };
    uint64_t bad = (w[0] ^ hdr[0]) | (w[1] ^ hdr[1]) | (w[2] ^ hdr[2]) | (w[3] ^ hdr[3]);
    uint64_t x = lcg_seed(index, gen);
    for (unsigned j = 0; j < BODY_WORDS; j++) {
        LCG_STEP(x);
        bad |= w[HDR_WORDS + j] ^ LCG_OUT(x);
    }
    if (bad == 0)
        return 0;

    /* Slow path: find the first differing word for the report. */
    int word = -1;
    uint64_t want = 0, got = 0;
    for (unsigned j = 0; j < HDR_WORDS && word < 0; j++)
        if (w[j] != hdr[j]) {
            word = (int)j;
            want = hdr[j];
            got = w[j];
        }
    x = lcg_seed(index, gen);
    for (unsigned j = 0; j < BODY_WORDS && word < 0; j++) {
        LCG_STEP(x);
        if (w[HDR_WORDS + j] != LCG_OUT(x)) {
            word = (int)(HDR_WORDS + j);
            want = LCG_OUT(x);
            got = w[HDR_WORDS + j];
        }
    }
    report_corruption(index, gen, w, word, want, got);
    if (read_only)
        return 1;
    expected_gen[index] = gen + 1;
    fill_page(index, gen + 1);
    return 1;
}

/* Prints the page frame ranges of the buffer from /proc/self/pagemap
 * (bits 0-54: PFN, bit 63: present; PFNs read as 0 without CAP_SYS_ADMIN). */
static void print_pfns(void)
{
    FILE *f = fopen("/proc/self/pagemap", "rb");
    if (f == NULL) {
        printf("memtouch: pfns unavailable: /proc/self/pagemap: %s\n", strerror(errno));
        return;
    }
    uint64_t first = 0, count = 0, ranges = 0, unknown = 0;
    for (uint64_t i = 0; i < npages; i++) {
        uint64_t e = 0;
        off_t at = (off_t)(((uintptr_t)mem / PAGE_SIZE + i) * sizeof e);
        uint64_t pfn = 0;
        if (fseeko(f, at, SEEK_SET) == 0 && fread(&e, sizeof e, 1, f) == 1 && (e >> 63))
            pfn = e & ((1ULL << 55) - 1);
        if (pfn == 0) {
            unknown++;
            continue;
        }
        if (count > 0 && pfn == first + count) {
            count++;
            continue;
        }
        if (count > 0) {
            printf("memtouch: pfns first=%" PRIu64 " count=%" PRIu64 "\n", first, count);
            ranges++;
        }
        first = pfn;
        count = 1;
    }
    if (count > 0) {
        printf("memtouch: pfns first=%" PRIu64 " count=%" PRIu64 "\n", first, count);
        ranges++;
    }
    fclose(f);
    printf("memtouch: pfns total=%" PRIu64 " ranges=%" PRIu64 " unknown=%" PRIu64 "\n",
           npages - unknown, ranges, unknown);
}

static void sleep_ms(int64_t ms)
{
    if (ms <= 0)
        return;
    struct timespec ts = { .tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L };
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

/*
 * Pace work at `rate` per second: returns how many items are due now.
 * A backlog is capped at one second's worth, so a long pause (VM stopped,
 * clock jump) does not cause a burst.
 */
struct pacer {
    uint64_t rate; /* 0 = unlimited */
    int64_t start_ms;
    uint64_t done;
};

static uint64_t pacer_due(struct pacer *p, int64_t now)
{
    if (p->rate == 0)
        return UINT64_MAX;
    uint64_t allowed = (uint64_t)(now - p->start_ms) * p->rate / 1000;
    if (allowed > p->done + p->rate) {
        /* Forget the backlog beyond one second. */
        p->done = allowed - p->rate;
    }
    return allowed > p->done ? allowed - p->done : 0;
}

/* Milliseconds until the pacer has one more item due. */
static int64_t pacer_wait_ms(const struct pacer *p, int64_t now)
{
    if (p->rate == 0)
        return 0;
    int64_t at = p->start_ms + (int64_t)((p->done + 1) * 1000 / p->rate);
    return at > now ? at - now : 0;
}

int main(int argc, char **argv)
{
    uint64_t mib = 0, rate = DEFAULT_RATE, hot_mib = 0, interval = 1, vrate = 0, inject = 0,
             niceness = 19;
    int opt, pfns = 0;

    line_buffered();
    while ((opt = getopt(argc, argv, "m:r:H:i:V:X:n:WPh")) != -1) {
        uint64_t *dst;
        switch (opt) {
        case 'W': read_only = 1; continue;
        case 'P': pfns = 1; continue;
        case 'm': dst = &mib; break;
        case 'r': dst = &rate; break;
        case 'H': dst = &hot_mib; break;
        case 'i': dst = &interval; break;
        case 'V': dst = &vrate; break;
        case 'X': dst = &inject; break;
        case 'n': dst = &niceness; break;
        default: usage(); return 2;
        }
        if (parse_u64(optarg, dst) != 0)
            usage();
    }
    if (optind != argc || mib == 0 || interval == 0 || mib > (1u << 20) || niceness > 19)
        usage();
    if (hot_mib > mib) {
        fprintf(stderr, "memtouch: -H %" PRIu64 " is larger than -m %" PRIu64 "\n", hot_mib, mib);
        usage();
    }

    npages = mib * (1024 * 1024 / PAGE_SIZE);
    uint64_t hot_pages = hot_mib ? hot_mib * (1024 * 1024 / PAGE_SIZE) : npages;
    size_t len = (size_t)(npages * PAGE_SIZE);

    mem = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) {
        fprintf(stderr, "memtouch: cannot allocate %" PRIu64 " MiB: %s\n", mib, strerror(errno));
        return 1;
    }
    int locked = mlock(mem, len) == 0;
    if (niceness > 0 && setpriority(PRIO_PROCESS, 0, (int)niceness) != 0)
        fprintf(stderr, "memtouch: setpriority: %s\n", strerror(errno));
    expected_gen = calloc(npages, sizeof *expected_gen);
    if (expected_gen == NULL) {
        fprintf(stderr, "memtouch: out of memory for the generation array\n");
        return 1;
    }

    int64_t t0 = now_ms();
    for (uint64_t i = 0; i < npages; i++) {
        expected_gen[i] = 1;
        fill_page(i, 1);
    }
    int64_t t1 = now_ms();
    if (read_only)
        rate = 0;
    printf("memtouch: start mib=%" PRIu64 " pages=%" PRIu64 " hot_pages=%" PRIu64
           " rate=%" PRIu64 " verify_rate=%" PRIu64 " nice=%" PRIu64 " mlock=%s fill_ms=%" PRId64
           "%s\n",
           mib, npages, hot_pages, rate, vrate, niceness, locked ? "yes" : "no", t1 - t0,
           read_only ? " read_only=yes" : "");
    if (pfns)
        print_pfns();

    uint64_t rng = rng_seed();
    uint64_t writes = 0, writes_at_report = 0, verified = 0, sweeps = 0, cursor = 0;
    struct pacer wp = { .rate = rate, .start_ms = t1, .done = 0 };
    struct pacer vp = { .rate = vrate, .start_ms = t1, .done = 0 };
    int64_t last_report = t1;
    int64_t next_report = t1 + (int64_t)interval * 1000;

    for (;;) {
        int64_t now = now_ms();
        if (now >= next_report) {
            double secs = (double)(now - last_report) / 1000.0;
            uint64_t wps = secs > 0 ? (uint64_t)((double)(writes - writes_at_report) / secs + 0.5) : 0;
            if (suppressed) {
                printf("MEMTOUCH-CORRUPTION suppressed=%" PRIu64 " more lines in this interval\n",
                       suppressed);
                suppressed = 0;
            }
            printf("memtouch: t=%" PRId64 " writes=%" PRIu64 " writes_per_s=%" PRIu64
                   " verified=%" PRIu64 " errors=%" PRIu64 " sweeps=%" PRIu64 "\n",
                   (now - t0) / 1000, writes, wps, verified, errors, sweeps);
            for (; inject > 0; inject--) {
                /* Flip one bit in a body word of a random page, behind the writer's back. */
                uint64_t i = rng_next(&rng) % npages;
                uint64_t *w = (uint64_t *)(mem + i * PAGE_SIZE);
                w[HDR_WORDS + rng_next(&rng) % BODY_WORDS] ^= 1ULL << (rng_next(&rng) % 64);
                printf("memtouch: self-test corrupted page=%" PRIu64 "\n", i);
            }
            writes_at_report = writes;
            last_report = now;
            lines_this_interval = 0;
            next_report += (int64_t)interval * 1000;
            if (next_report <= now) /* we were paused: do not report in a burst */
                next_report = now + (int64_t)interval * 1000;
        }

        uint64_t wdue = read_only ? 0 : pacer_due(&wp, now);
        uint64_t vdue = pacer_due(&vp, now);
        if (wdue == 0 && vdue == 0) {
            int64_t wait = read_only ? INT64_MAX : pacer_wait_ms(&wp, now);
            int64_t vwait = pacer_wait_ms(&vp, now);
            if (vp.rate && vwait < wait)
                wait = vwait;
            if (next_report - now < wait)
                wait = next_report - now;
            sleep_ms(wait > 0 ? wait : 1);
            continue;
        }

        uint64_t n = wdue < CHUNK ? wdue : CHUNK;
        for (uint64_t k = 0; k < n; k++) {
            uint64_t i = rng_next(&rng) % hot_pages;
            expected_gen[i]++;
            fill_page(i, expected_gen[i]);
        }
        writes += n;
        wp.done += n;

        n = vdue < CHUNK ? vdue : CHUNK;
        for (uint64_t k = 0; k < n; k++) {
            verify_page(cursor);
            if (++cursor == npages) {
                cursor = 0;
                sweeps++;
            }
        }
        verified += n;
        vp.done += n;
    }
}
