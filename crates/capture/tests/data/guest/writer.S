/*
 * writer: a tiny PVH guest for vmcsnap-migstream's test fixtures.
 *
 * Booted by QEMU's microvm (qboot) through the PVH ELF note. It runs in
 * 32-bit protected mode without paging and, forever:
 *   - increments the 32-bit counter at guest-physical COUNTER (0x1ff000);
 *   - stores the counter into the first word of every 16th page from
 *     MARK_START (2 MiB) up to MARK_END (10 MiB), i.e. 128 marker pages.
 * It uses no stack and touches no other memory, so the pages it writes are
 * exactly: COUNTER and the 128 marker pages.
 */
        .set COUNTER,    0x1ff000
        .set MARK_START, 0x200000
        .set MARK_END,   0xa00000
        .set MARK_STEP,  0x10000

        .section .note.Xen, "a", @note
        .align 4
        .long 4                 /* namesz: "Xen\0" */
        .long 4                 /* descsz */
        .long 18                /* XEN_ELFNOTE_PHYS32_ENTRY */
        .asciz "Xen"
        .align 4
        .long _start

        .text
        .code32
        .globl _start
_start:
        cli
again:
        incl COUNTER
        movl COUNTER, %eax
        movl $MARK_START, %edi
mark:
        movl %eax, (%edi)
        addl $MARK_STEP, %edi
        cmpl $MARK_END, %edi
        jb mark
        jmp again
