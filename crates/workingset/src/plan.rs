//! Restore plans: which pages go before the guest starts, which order the
//! rest follow in, and how many pages one demand fault brings.
//!
//! | mode | before the guest starts | after it starts |
//! |---|---|---|
//! | `eager` | every page, in image order | nothing left |
//! | `lazy` | nothing | demand faults (1 page each); background push in address order |
//! | `workingset` (HotRestore) | the first WSS pages of the FAFL queue, sorted by image offset (merged sequential reads) | demand faults bring 4 neighbouring pages (DMA cluster); background: rest of the FAFL queue in queue order, then everything else in image order |
//! | `sampling-ws` (VMware's working set restore) | WSS_sample pages of the traced set, chosen and loaded in address order, without FAFL order | demand faults (1 page); background in image order |
//!
//! "Image order" is the order of pages in the memory image (file offset;
//! zero pages, which cost no read, after the stored ones in address order).

use vmcsnap_image::PageKey;

/// Pages a demand fault brings in `workingset` mode (HotRestore §5.2).
pub const DMA_CLUSTER: u32 = 4;

/// A restore mode (defined with the other option enums in the control
/// protocol).
pub use vmcsnap_control::RestoreMode as Mode;

/// What a plan is made from.
#[derive(Debug, Clone)]
pub struct PlanInput<'a> {
    /// Pages of each RAM block.
    pub block_pages: &'a [u32],
    /// Every page once, in image order.
    pub image_order: &'a [PageKey],
    /// The FAFL queue (see [`crate::queue`]).
    pub queue: &'a [PageKey],
    /// Working-set size in pages for `workingset` (for `sampling-ws`, the
    /// sampled size is used instead).
    pub wss: u64,
    /// The sampled working-set size (pages), for `sampling-ws`.
    pub wss_sample: Option<u64>,
}

/// A restore plan.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    /// Sent before the guest starts, in this order.
    pub before_run: Vec<PageKey>,
    /// Background push order after the start; pages not listed follow in
    /// address order.
    pub background: Vec<PageKey>,
    /// Pages one demand fault brings (the faulting page and the next ones).
    pub demand_cluster: u32,
}

/// A plan that cannot be made.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlanError {
    /// A queue entry names a page the VM does not have.
    #[error("the FAFL queue names page {page} of RAM block {block}, which has {pages} pages: the trace does not belong to this snapshot")]
    QueueOutOfRange {
        /// RAM block.
        block: u32,
        /// Page.
        page: u32,
        /// Pages of that block (0 if the block does not exist).
        pages: u32,
    },
    /// The image order is not every page exactly once.
    #[error("the image order lists {listed} pages, the RAM blocks have {total}: the image index is inconsistent (run `vmcsnap inspect --verify`)")]
    BadImageOrder {
        /// Pages listed.
        listed: usize,
        /// Pages the blocks have.
        total: u64,
    },
}

/// Rank of every page in image order: `rank[block][page]`.
fn ranks(input: &PlanInput) -> Result<Vec<Vec<u32>>, PlanError> {
    let total: u64 = input.block_pages.iter().map(|&n| u64::from(n)).sum();
    let bad = || PlanError::BadImageOrder {
        listed: input.image_order.len(),
        total,
    };
    if input.image_order.len() as u64 != total {
        return Err(bad());
    }
    let mut r: Vec<Vec<u32>> = input
        .block_pages
        .iter()
        .map(|&n| vec![u32::MAX; n as usize])
        .collect();
    for (i, k) in input.image_order.iter().enumerate() {
        let slot = r
            .get_mut(k.ram_block as usize)
            .and_then(|b| b.get_mut(k.page as usize))
            .ok_or_else(bad)?;
        if *slot != u32::MAX {
            return Err(bad());
        }
        *slot = i as u32;
    }
    Ok(r)
}

fn check_queue(input: &PlanInput) -> Result<(), PlanError> {
    for k in input.queue {
        let pages = input
            .block_pages
            .get(k.ram_block as usize)
            .copied()
            .unwrap_or(0);
        if k.page >= pages {
            return Err(PlanError::QueueOutOfRange {
                block: k.ram_block,
                page: k.page,
                pages,
            });
        }
    }
    Ok(())
}

/// Makes the plan for `mode`.
pub fn make_plan(mode: Mode, input: &PlanInput) -> Result<Plan, PlanError> {
    check_queue(input)?;
    let rank = ranks(input)?;
    let by_image =
        |v: &mut Vec<PageKey>| v.sort_by_key(|k| rank[k.ram_block as usize][k.page as usize]);
    let mut taken: Vec<Vec<bool>> = input
        .block_pages
        .iter()
        .map(|&n| vec![false; n as usize])
        .collect();
    let mut take = |k: PageKey| -> bool {
        let t = &mut taken[k.ram_block as usize][k.page as usize];
        !std::mem::replace(t, true)
    };
    Ok(match mode {
        Mode::Eager => Plan {
            before_run: input.image_order.to_vec(),
            background: vec![],
            demand_cluster: 1,
        },
        Mode::Lazy => Plan {
            before_run: vec![],
            background: vec![],
            demand_cluster: 1,
        },
        Mode::Workingset => {
            let n = usize::try_from(input.wss).unwrap_or(usize::MAX);
            let mut ws: Vec<PageKey> = Vec::new();
            let mut rest = Vec::new();
            for &k in input.queue {
                if take(k) {
                    if ws.len() < n {
                        ws.push(k)
                    } else {
                        rest.push(k)
                    }
                }
            }
            by_image(&mut ws);
            rest.extend(input.image_order.iter().copied().filter(|&k| take(k)));
            Plan {
                before_run: ws,
                background: rest,
                demand_cluster: DMA_CLUSTER,
            }
        }
        Mode::SamplingWs => {
            let n = usize::try_from(input.wss_sample.unwrap_or(input.wss)).unwrap_or(usize::MAX);
            let mut traced: Vec<PageKey> = input.queue.to_vec();
            traced.sort_unstable();
            traced.dedup();
            traced.truncate(n);
            for &k in &traced {
                take(k);
            }
            by_image(&mut traced);
            let rest = input
                .image_order
                .iter()
                .copied()
                .filter(|&k| take(k))
                .collect();
            Plan {
                before_run: traced,
                background: rest,
                demand_cluster: 1,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(p: u32) -> PageKey {
        PageKey::new(0, p)
    }

    /// 8 pages; the image stores 7, 6, 5, 4 first (say, written late), then 0..4.
    fn input<'a>(order: &'a [PageKey], queue: &'a [PageKey], wss: u64) -> PlanInput<'a> {
        PlanInput {
            block_pages: &[8],
            image_order: order,
            queue,
            wss,
            wss_sample: Some(3),
        }
    }

    fn image_order() -> Vec<PageKey> {
        [7, 6, 5, 4, 0, 1, 2, 3].map(k).to_vec()
    }

    #[test]
    fn eager_sends_everything_in_image_order() {
        let o = image_order();
        let p = make_plan(Mode::Eager, &input(&o, &[], 0)).unwrap();
        assert_eq!(p.before_run, o);
        assert!(p.background.is_empty());
    }

    #[test]
    fn lazy_sends_nothing_first() {
        let o = image_order();
        let p = make_plan(Mode::Lazy, &input(&o, &[k(1)], 5)).unwrap();
        assert!(p.before_run.is_empty() && p.background.is_empty());
        assert_eq!(p.demand_cluster, 1);
    }

    #[test]
    fn workingset_is_the_queue_prefix_in_image_order_then_queue_then_image() {
        let o = image_order();
        let q = [k(1), k(6), k(3), k(1), k(0)];
        let p = make_plan(Mode::Workingset, &input(&o, &q, 2)).unwrap();
        assert_eq!(
            p.before_run,
            vec![k(6), k(1)],
            "queue prefix {{1, 6}} sorted by image offset"
        );
        assert_eq!(p.background, vec![k(3), k(0), k(7), k(5), k(4), k(2)]);
        assert_eq!(p.demand_cluster, DMA_CLUSTER);
        // A size beyond the queue takes the whole queue.
        let p = make_plan(Mode::Workingset, &input(&o, &q, 100)).unwrap();
        assert_eq!(p.before_run, vec![k(6), k(0), k(1), k(3)]);
    }

    #[test]
    fn sampling_ws_takes_the_sampled_size_in_address_order() {
        let o = image_order();
        let q = [k(6), k(3), k(1), k(0)];
        let p = make_plan(Mode::SamplingWs, &input(&o, &q, 1)).unwrap();
        // wss_sample = 3: the three lowest traced addresses 0, 1, 3 (not 6, the first written).
        assert_eq!(p.before_run, vec![k(0), k(1), k(3)]);
        assert_eq!(p.background, vec![k(7), k(6), k(5), k(4), k(2)]);
    }

    #[test]
    fn bad_inputs_are_named() {
        let o = image_order();
        let e = make_plan(Mode::Workingset, &input(&o, &[k(8)], 1)).unwrap_err();
        assert_eq!(
            e,
            PlanError::QueueOutOfRange {
                block: 0,
                page: 8,
                pages: 8
            }
        );
        let short = [k(0)];
        assert!(matches!(
            make_plan(Mode::Eager, &input(&short, &[], 1)),
            Err(PlanError::BadImageOrder { .. })
        ));
        let dup = [0, 0, 1, 2, 3, 4, 5, 6].map(k);
        assert!(matches!(
            make_plan(Mode::Eager, &input(&dup, &[], 1)),
            Err(PlanError::BadImageOrder { .. })
        ));
    }
}
