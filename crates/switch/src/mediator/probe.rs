//! Cut probes: making sure a VM's QEMU has handed every frame to the guest
//! before the VM is paused for its cut (or before its QEMU is restarted,
//! which loses QEMU's net queue the same way). The wait itself is
//! [`SwitchHandle::settle`](crate::SwitchHandle::settle).
//!
//! # Why `SIOCOUTQ == 0` is not enough
//!
//! QEMU's stream netdev reads its socket in chunks of up to 68 KiB and
//! passes each frame to the NIC. When the guest has no free receive buffer
//! (its virtio-net rx ring is full, e.g. a TCG vCPU that has not run for a
//! while), QEMU keeps the frame, and every later frame of the chunk, in its
//! own net queue and stops reading the socket until the guest frees buffers.
//! Frames in that queue have left the switch's socket (`SIOCOUTQ` is 0) but
//! are neither in guest memory nor in QEMU's migration stream: the VM
//! snapshotted at that moment never received them, and a VM restored from
//! the snapshot never will. Its peers' TCP then retransmits them after the
//! restore (seen in CI: 2 segments after every restore of one snapshot,
//! even with all memory loaded before the start).
//!
//! # The probe
//!
//! After the hold and the drain, the switch writes a *probe*: a frame the
//! guest's NIC discards (unicast to a MAC no VM has, see [`PROBE_FRAME`]),
//! then waits until QEMU has read it. QEMU reads its socket only while its
//! net queue is not stalled, and a frame queued behind others is handed
//! on, and reading resumed, only after all of them. So:
//!
//! - a probe read means QEMU was reading again after everything written
//!   before it had been read; if the queue was stalled at that moment the
//!   probe itself was queued, behind the real frames;
//! - a **second** probe read after the first means the first one left the
//!   queue (QEMU resumes reading when a queued frame is delivered, in
//!   order), so every real frame before it reached the guest.
//!
//! Two probes read in turn is therefore the condition for a pause whose
//! snapshot holds everything the switch wrote to the VM. A probe left in
//! QEMU's queue at the pause is harmless: the NIC discards it after resume,
//! and a restore never sees it. The one gap is a partial flush racing the
//! guest adding buffers without a notification, which QEMU's rx path makes
//! a window of a few instructions.
//!
//! The probe is never counted as forwarded, never learnt from, never
//! logged. If the NIC is promiscuous the probe reaches the guest's kernel,
//! which drops it (an unknown EtherType for another host).

/// Destination and source of a probe: locally administered unicast
/// addresses ("vmcs" + 0x00) no VM of a cluster is given (VM MACs start
/// with 52:54:00, QEMU's prefix).
pub const PROBE_MAC: [u8; 6] = [0x02, b'v', b'm', b'c', b's', 0x00];

/// IEEE 802 local experimental EtherType 1.
pub const PROBE_ETHERTYPE: u16 = 0x88b5;

/// The probe frame: 60 bytes (the Ethernet minimum without FCS).
pub const PROBE_FRAME: [u8; 60] = probe_frame();

const fn probe_frame() -> [u8; 60] {
    let mut f = [0u8; 60];
    let mut i = 0;
    while i < 6 {
        f[i] = PROBE_MAC[i];
        f[6 + i] = PROBE_MAC[i];
        i += 1;
    }
    let et = PROBE_ETHERTYPE.to_be_bytes();
    f[12] = et[0];
    f[13] = et[1];
    let tag = *b"vmcsnap cut probe";
    let mut j = 0;
    while j < tag.len() {
        f[14 + j] = tag[j];
        j += 1;
    }
    f
}

/// How many probes in turn must be read before a pause (see the module doc).
pub const PROBES_BEFORE_PAUSE: u32 = 2;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_is_unicast_to_a_mac_no_vm_has() {
        assert_eq!(
            PROBE_FRAME[0] & 1,
            0,
            "unicast: a NIC that is not promiscuous drops it"
        );
        assert_eq!(PROBE_FRAME[0] & 2, 2, "locally administered");
        assert_ne!(
            &PROBE_FRAME[..3],
            &[0x52, 0x54, 0x00],
            "not QEMU's prefix, which VMs use"
        );
        assert_eq!(&PROBE_FRAME[12..14], &[0x88, 0xb5]);
        assert_eq!(&PROBE_FRAME[..6], &PROBE_FRAME[6..12]);
        assert!(PROBE_FRAME[14..].starts_with(b"vmcsnap cut probe"));
    }
}
