/*
 * Pins the build's entropy so that two builds of the guest behave the same.
 *
 * componentize-py snapshots CPython after the guest runner is imported, and CPython draws its
 * str/bytes hash seed (and the random module's first state) from wasi:random during that
 * import. componentize-py serves wasi:random from this process's OS entropy, and
 * PYTHONHASHSEED does not reach the pre-init interpreter. Preloading this library into the
 * build process replaces every OS entropy source it uses with one fixed xorshift stream, so
 * `list({'a', 'b', 'c'})` prints the same on every build and every machine.
 *
 * Build-time only: nothing here is linked into wasibox or the guest.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdarg.h>
#include <stddef.h>
#include <sys/syscall.h>
#include <sys/types.h>

static unsigned long long state = 0x9E3779B97F4A7C15ULL;

static void fill(void *buf, size_t len) {
    unsigned char *out = buf;
    for (size_t i = 0; i < len; i++) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out[i] = (unsigned char)(state >> 24);
    }
}

ssize_t getrandom(void *buf, size_t len, unsigned int flags) {
    (void)flags;
    fill(buf, len);
    return (ssize_t)len;
}

int getentropy(void *buf, size_t len) {
    fill(buf, len);
    return 0;
}

/* Rust's std may call the getrandom syscall through syscall(2) rather than the libc wrapper. */
long syscall(long number, ...) {
    va_list ap;
    long arg[6];
    va_start(ap, number);
    for (int i = 0; i < 6; i++) arg[i] = va_arg(ap, long);
    va_end(ap);
    if (number == SYS_getrandom) {
        fill((void *)arg[0], (size_t)arg[1]);
        return arg[1];
    }
    static long (*real_syscall)(long, ...);
    if (!real_syscall) real_syscall = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
    return real_syscall(number, arg[0], arg[1], arg[2], arg[3], arg[4], arg[5]);
}

