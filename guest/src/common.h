/*
 * common.h - small helpers shared by the vmcsnap guest programs.
 *
 * Everything here is static inline so each program stays a single
 * translation unit: gcc -static -O2 -Wall -Wextra -o prog prog.c
 *
 * Rules the programs follow:
 *  - stdout is line-buffered (a serial console shows every line promptly);
 *  - only numeric IPv4 addresses (no name resolution in static binaries);
 *  - time is CLOCK_MONOTONIC, which does not advance while the VM is paused.
 */
#ifndef VMCSNAP_COMMON_H
#define VMCSNAP_COMMON_H

#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* Milliseconds since an arbitrary point (CLOCK_MONOTONIC). */
static inline int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Make stdout line-buffered even when it is a file or a serial console. */
static inline void line_buffered(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    setvbuf(stderr, NULL, _IOLBF, 0);
    /* A peer closing a socket must not kill us. */
    signal(SIGPIPE, SIG_IGN);
}

/* Parse a decimal unsigned number; exits via usage() on garbage. */
static inline int parse_u64(const char *s, uint64_t *out)
{
    char *end = NULL;
    if (s == NULL || *s == '\0' || *s == '-')
        return -1;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0')
        return -1;
    *out = (uint64_t)v;
    return 0;
}

static inline int parse_port(const char *s, uint16_t *port)
{
    uint64_t v;
    if (parse_u64(s, &v) != 0 || v == 0 || v > 65535)
        return -1;
    *port = (uint16_t)v;
    return 0;
}

static inline int set_nonblock(int fd, int on)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0)
        return -1;
    fl = on ? (fl | O_NONBLOCK) : (fl & ~O_NONBLOCK);
    return fcntl(fd, F_SETFL, fl);
}

static inline void set_nodelay(int fd)
{
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/* TCP listener on 0.0.0.0:port (SO_REUSEADDR); exits on failure. */
static inline int listen_tcp(uint16_t port, const char *prog)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        fprintf(stderr, "%s: socket: %s\n", prog, strerror(errno));
        exit(1);
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons(port);
    sa.sin_addr.s_addr = htonl(INADDR_ANY);
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(fd, 64) != 0) {
        fprintf(stderr, "%s: bind/listen on port %u: %s\n", prog, port, strerror(errno));
        exit(1);
    }
    return fd;
}

/*
 * Connect to ip:port within timeout_ms. Returns a blocking socket with
 * TCP_NODELAY set, or -1 with *err set to a short reason.
 */
static inline int connect_tcp(const struct in_addr *ip, uint16_t port, int timeout_ms,
                              const char **err)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        *err = strerror(errno);
        return -1;
    }
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons(port);
    sa.sin_addr = *ip;
    set_nonblock(fd, 1);
    int rc = connect(fd, (struct sockaddr *)&sa, sizeof sa);
    if (rc != 0 && errno != EINPROGRESS) {
        *err = strerror(errno);
        close(fd);
        return -1;
    }
    if (rc != 0) {
        struct pollfd p = { .fd = fd, .events = POLLOUT };
        rc = poll(&p, 1, timeout_ms);
        if (rc <= 0) {
            *err = rc == 0 ? "connect timeout" : strerror(errno);
            close(fd);
            return -1;
        }
        int soerr = 0;
        socklen_t len = sizeof soerr;
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len);
        if (soerr != 0) {
            *err = strerror(soerr);
            close(fd);
            return -1;
        }
    }
    set_nonblock(fd, 0);
    set_nodelay(fd);
    /* Notice a dead peer within ~20 s even if nothing is in flight. */
    int one = 1, idle = 5, intvl = 3, cnt = 5;
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
    return fd;
}

/* Write all of buf to a blocking fd. Returns 0 or -1 (errno set). */
static inline int write_all(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/* xorshift64* PRNG: cheap, good enough for choosing pages and keys. */
static inline uint64_t rng_next(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545F4914F6CDD1DULL;
}

static inline uint64_t rng_seed(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t s = ((uint64_t)ts.tv_sec << 32) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 16);
    return s ? s : 0x9E3779B97F4A7C15ULL;
}

#endif
