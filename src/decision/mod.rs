//! The decision on one request: bounds, matching, one atomic backend call, answers.
//!
//! Transport-neutral: the gRPC service (and the HTTP `/json` endpoint) turn
//! wire messages into a [`Request`] and a [`Decision`] back into wire
//! messages; no prost type is seen here.
//!
//! A request goes through the files of this module in order:
//!
//! - `request`: the request types and their bounds;
//! - `plan`: each descriptor matched against the rules, `replaces` applied,
//!   overrides turned into limits (`overrides`), checks on one counter merged;
//! - the backend call, here in [`Limiter::decide`], unless `over_limit`
//!   already knows every counter the request reaches is full;
//! - `answer`: the most restrictive limit of each descriptor, its status and
//!   its metric; `headers`: the `RateLimit-*` headers of the request;
//! - `resend`: a charge (a limit charged always) whose call was not
//!   written in its caller's time, sent again afterwards.
//!
//! `labels` turns request bytes into text for logs and metric labels.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;

use crate::algorithms::Verdict;
use crate::backends::{self, Backend, CallContext};
use crate::log_gate::LogGate;
use crate::metrics::{self, BackendMetrics, Method, Metrics};
use crate::rules::RuleSet;

mod answer;
mod headers;
mod labels;
mod over_limit;
mod overrides;
mod plan;
mod request;
mod resend;
mod traced;

pub use answer::{Code, CurrentLimit, Decision, Status};
pub use headers::HeaderNames;
pub use labels::{bytes_label, printable};
pub use request::{
    Descriptor, EnforcedOverride, Entry, LimitOverride, MAX_DESCRIPTORS, MAX_ENTRIES, Request,
};

pub use over_limit::OverLimitCache;
use plan::Plan;
pub use resend::{MAX_RESENDS, RESEND_WITHIN};
pub use traced::{BackendCall, BackendCallTimes};

/// What to answer when the backend fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureMode {
    /// Fail the call: the gRPC service answers UNAVAILABLE and Envoy's own
    /// `failure_mode_deny` decides.
    Error,
    /// Answer OK.
    Allow,
    /// Answer OVER_LIMIT.
    Deny,
}

/// The share of a limit used past which an allowed decision is counted as
/// `near_limit` rather than `ok` (as envoyproxy/ratelimit's near_limit):
/// with the default 0.8, less than 20% of the most restrictive limit left.
///
/// Held in millionths, so that comparing it with whole counts is exact: the
/// default is the same boundary as `remaining × 5 < capacity`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NearLimitRatio {
    millionths: u64,
}

impl NearLimitRatio {
    /// 0.8.
    pub const DEFAULT: NearLimitRatio = NearLimitRatio {
        millionths: 800_000,
    };

    /// `ratio` if it is a share, from 0 to 1 (to the millionth).
    pub fn new(ratio: f64) -> Option<NearLimitRatio> {
        if !(0.0..=1.0).contains(&ratio) {
            return None;
        }
        // In 0..=1_000_000 after the range check: the cast is exact.
        let millionths = (ratio * 1_000_000.0).round() as u64;
        Some(NearLimitRatio { millionths })
    }

    pub fn get(self) -> f64 {
        self.millionths as f64 / 1_000_000.0
    }

    /// Whether `remaining` of `capacity` leaves more than this share used.
    pub fn is_near(self, remaining: u64, capacity: u64) -> bool {
        let used = u128::from(capacity.saturating_sub(remaining));
        used * 1_000_000 > u128::from(self.millionths) * u128::from(capacity)
    }
}

impl Default for NearLimitRatio {
    fn default() -> Self {
        NearLimitRatio::DEFAULT
    }
}

/// Counters the over-limit cache holds by default: each costs its counter
/// key (about 100 to 300 bytes), so a few MB at most.
pub const DEFAULT_OVER_LIMIT_CACHE: usize = 16_384;

/// Service-wide behaviour of the limiter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// Report an OVER_LIMIT overall code as OK (statuses unchanged).
    pub shadow_mode: bool,
    /// `None`: no response headers.
    pub response_headers: Option<HeaderNames>,
    pub failure_mode: FailureMode,
    /// Where `ok` ends and `near_limit` begins in the decision metrics.
    pub near_limit_ratio: NearLimitRatio,
    /// Most counters the over-limit cache holds; 0 turns it off. Used only
    /// with a backend that has a [`Backend::local_clock`].
    pub over_limit_cache: usize,
}

/// `serve`'s defaults: not in shadow mode, the standard response headers,
/// a failing backend answered as an error, the default near-limit ratio and
/// over-limit cache.
impl Default for Options {
    fn default() -> Options {
        Options {
            shadow_mode: false,
            response_headers: Some(HeaderNames::standard()),
            failure_mode: FailureMode::Error,
            near_limit_ratio: NearLimitRatio::DEFAULT,
            over_limit_cache: DEFAULT_OVER_LIMIT_CACHE,
        }
    }
}

/// Why a request got no decision.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    InvalidArgument(String),
    #[error(transparent)]
    Backend(backends::Error),
    /// No config has arrived yet (`RuleSet::awaiting_first_config`), and
    /// `--failure-mode error`.
    #[error("no rate-limit config received yet")]
    NoConfig,
}

/// Decides requests against the current rules and a backend.
#[derive(Debug)]
pub struct Limiter {
    /// Shared with the backend calls still running after their callers
    /// left, so that what they decide is counted.
    shared: Arc<Shared>,
}

/// Everything of a [`Limiter`].
#[derive(Debug)]
struct Shared {
    rules: Arc<ArcSwap<RuleSet>>,
    backend: Arc<dyn Backend>,
    options: Options,
    backend_errors: LogGate,
    /// Requests whose cost exceeds a limit's capacity: clients choose them.
    never_pass: LogGate,
    metrics: Arc<Metrics>,
    /// `metrics`' series for `backend`, resolved once.
    backend_metrics: BackendMetrics,
    /// Counters the backend reported full, answered without it.
    over_limit: Option<OverLimitCache>,
    /// Charges held to be sent again after their caller's time.
    resends: resend::Resends,
}

// === impl Limiter ===

impl Limiter {
    /// A limiter recording its decisions and backend calls in `metrics`.
    pub fn new(
        rules: Arc<ArcSwap<RuleSet>>,
        backend: Arc<dyn Backend>,
        options: Options,
        metrics: Arc<Metrics>,
    ) -> Self {
        let backend_metrics = metrics.backend(backend.name());
        let over_limit = backend
            .local_clock()
            .and_then(|clock| OverLimitCache::new(options.over_limit_cache, clock));
        let shared = Shared {
            rules,
            backend,
            options,
            backend_errors: LogGate::new(),
            never_pass: LogGate::new(),
            metrics,
            backend_metrics,
            over_limit,
            resends: resend::Resends::default(),
        };
        Self {
            shared: Arc::new(shared),
        }
    }

    /// Where decisions, backend calls and reloads are counted.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.shared.metrics
    }

    /// The rules in force; a reload stores a new set here.
    pub fn rules(&self) -> &Arc<ArcSwap<RuleSet>> {
        &self.shared.rules
    }

    /// Readies the backend for the calling thread's first decision (see
    /// [`Backend::warm_up`]).
    pub async fn warm_up(&self) {
        self.shared.backend.warm_up().await;
    }

    /// Decides one request for a caller without a deadline (see
    /// [`Limiter::decide_within`]).
    pub async fn decide(&self, request: &Request) -> Result<Decision, Error> {
        self.decide_within(request, Caller::unbounded(Method::ShouldRateLimit))
            .await
    }

    /// Decides one request: at most one backend call, none when no
    /// descriptor needs a counter.
    ///
    /// Within `caller.deadline`: a backend call is started only while at
    /// least [`MIN_BACKEND_TIME`] is left before [`ANSWER_MARGIN`] ahead
    /// of it, and awaited no later than that margin; otherwise the request
    /// is answered through the failure mode and counted as abandoned
    /// (stage `deadline`, or the stage its call had reached).
    ///
    /// A decision the backend makes is counted (decisions, hits) whether
    /// or not anyone reads it: a call written to the backend when its
    /// caller leaves (a cancelled call, a passed deadline) is finished in
    /// a task of its own; one whose reply comes after the backend's own
    /// timeout (answered through the failure mode) is counted when the
    /// backend hands it over ([`CallContext::late`],
    /// `throttlegate_late_replies_total`). A call not yet written is
    /// dropped unsent, unless it is a charge (a limit charged always, with
    /// a cost): that is sent again after its caller's time (`resend`).
    pub async fn decide_within(
        &self,
        request: &Request,
        caller: Caller,
    ) -> Result<Decision, Error> {
        let shared = &self.shared;
        request::validate(request)?;
        // One snapshot per request: a reload mid-request cannot mix rule sets.
        let rules = shared.rules.load_full();
        if rules.is_awaiting_first_config() {
            return shared.answer_without_config(request);
        }
        let Some(domain) = rules.domain(&request.domain) else {
            return Ok(shared.answer_unknown_domain(request));
        };
        let plan = plan::plan(domain, request, rules.max_log_entries())?;
        if plan.checks.is_empty() {
            return Ok(shared.answer(domain, &plan, None));
        }
        shared.warn_never_pass(request, &plan);
        if let Some(verdict) = shared.known_over_limit(&rules, &plan) {
            return Ok(shared.answer(domain, &plan, Some(&verdict)));
        }
        let answer_by = caller
            .deadline
            .map(|it| it.checked_sub(ANSWER_MARGIN).unwrap_or(it));
        let send_by = answer_by.map(|it| it.checked_sub(MIN_BACKEND_TIME).unwrap_or(it));
        // Decided before any deadline could pass: nothing to bound.
        if shared.backend.answers_at_once() {
            let traced = caller.traced.as_deref();
            return match shared.call_backend(&rules, &plan, None, traced).await {
                Ok(verdict) => Ok(shared.answer(domain, &plan, Some(&verdict))),
                Err(error) => shared.on_backend_error(&plan, error),
            };
        }
        let charge = resend::is_charge(&plan);
        let plan = Arc::new(plan);
        let planned = resend::PlannedCall {
            shared: shared.clone(),
            rules,
            domain: request.domain.clone(),
            plan: plan.clone(),
        };
        if send_by.is_some_and(|it| it <= Instant::now()) {
            shared
                .metrics
                .record_abandoned(caller.method, backends::Stage::Deadline);
            if charge {
                planned.resend();
            }
            return shared.failure_answer(&plan, backends::Error::Deadline);
        }
        let mut pending = Pending::start(planned, &caller, send_by, charge);
        let finished = match answer_by {
            None => Some((&mut pending).await),
            Some(answer_by) => tokio::time::timeout_at(answer_by.into(), &mut pending)
                .await
                .ok(),
        };
        match finished {
            Some(Ok(decision)) => Ok(decision),
            Some(Err(backends::Error::Deadline)) => {
                shared
                    .metrics
                    .record_abandoned(caller.method, backends::Stage::Deadline);
                shared.failure_answer(&plan, backends::Error::Deadline)
            }
            Some(Err(error)) => shared.failure_answer(&plan, error),
            None => {
                // Counted as abandoned at the stage reached; a call already
                // with the backend finishes without its caller.
                drop(pending);
                shared.failure_answer(&plan, backends::Error::Deadline)
            }
        }
    }
}

/// Who asks for a decision: by which method, until when, and whether it
/// traces the backend call.
#[derive(Debug, Clone)]
pub struct Caller {
    pub method: Method,
    /// When the caller gives up (its `grpc-timeout`, or the server's
    /// request timeout); `None`: it waits as long as the backend takes.
    pub deadline: Option<Instant>,
    /// Where the backend call is recorded for the caller's trace; `None`
    /// (not traced): nothing is recorded.
    pub traced: Option<Arc<BackendCall>>,
}

impl Caller {
    pub fn unbounded(method: Method) -> Caller {
        Caller {
            method,
            deadline: None,
            traced: None,
        }
    }
}

/// A request is answered this long before its caller's deadline, for the
/// answer to reach the caller in time: tokio's timers fire up to 1 ms
/// after their instant (a millisecond wheel), and writing the answer and
/// its way back over a local network take well under another.
pub const ANSWER_MARGIN: Duration = Duration::from_millis(2);

/// The least time before the answer is due for which a backend call is
/// started: a Redis decision on a healthy local network takes 0.1 to
/// 0.5 ms, so with less left its answer would come too late even from a
/// healthy Redis, and would only be work nobody waits for.
pub const MIN_BACKEND_TIME: Duration = Duration::from_millis(1);

/// A backend call and the counting of what it decides, owned, so that it
/// can finish in a task of its own when its caller leaves.
type Finish = Pin<Box<dyn Future<Output = Result<Decision, backends::Error>> + Send>>;

/// A backend call in progress for one caller. Dropped before it finished
/// (its caller cancelled or out of time), it counts the call as
/// abandoned at the stage reached and, when the call is already with the
/// backend, hands it to a task of its own to finish and be counted; a
/// charge not yet written is sent again (`resend`).
struct Pending {
    finish: Option<Finish>,
    progress: backends::Progress,
    method: Method,
    metrics: Arc<Metrics>,
    /// A charge's call, sent again if it is dropped unwritten.
    unsent: Option<resend::PlannedCall>,
}

impl Pending {
    /// Starts `planned`; with `charge`, a call dropped or failed unwritten
    /// is sent again (`resend`).
    fn start(
        planned: resend::PlannedCall,
        caller: &Caller,
        send_by: Option<Instant>,
        charge: bool,
    ) -> Pending {
        let progress = backends::Progress::new(backends::Stage::Decide);
        let traced = caller.traced.clone();
        let late = {
            let resend::PlannedCall {
                shared,
                rules,
                domain,
                plan,
            } = planned.clone();
            backends::LateVerdict::new(move |verdict| {
                shared.count_late(&rules, &domain, &plan, &verdict);
            })
        };
        let call = CallContext {
            send_by,
            progress: progress.clone(),
            late: Some(late),
        };
        let metrics = planned.shared.metrics.clone();
        let unsent = charge.then(|| planned.clone());
        let finish: Finish = Box::pin(async move {
            let resend::PlannedCall {
                shared,
                rules,
                domain,
                plan,
            } = &planned;
            let called = shared.call_backend(rules, plan, Some(&call), traced.as_deref());
            let verdict = match called.await {
                Ok(verdict) => verdict,
                Err(error) => {
                    if charge && call.progress.get() != backends::Stage::Backend {
                        planned.clone().resend();
                    }
                    if !matches!(error, backends::Error::Deadline) {
                        shared.record_backend_error(&error);
                    }
                    return Err(error);
                }
            };
            match rules.domain(domain) {
                Some(domain) => Ok(shared.answer(domain, plan, Some(&verdict))),
                // The domain was found in this very rule set.
                None => Err(backends::Error::Protocol("domain vanished".into())),
            }
        });
        Pending {
            finish: Some(finish),
            progress,
            method: caller.method,
            metrics,
            unsent,
        }
    }
}

impl Future for Pending {
    type Output = Result<Decision, backends::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let Some(finish) = this.finish.as_mut() else {
            return Poll::Pending;
        };
        let output = std::task::ready!(finish.as_mut().poll(cx));
        this.finish = None;
        Poll::Ready(output)
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let Some(finish) = self.finish.take() else {
            return;
        };
        // From here on a call not yet written never will be (a batch
        // checks before writing each of its requests).
        let stage = self.progress.leave();
        self.metrics.record_abandoned(self.method, stage);
        if stage != backends::Stage::Backend {
            // Not written: dropped unsent, nothing consumed; a charge is
            // sent again.
            if let Some(unsent) = self.unsent.take() {
                unsent.resend();
            }
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = finish.await;
            });
        }
    }
}

// === impl Shared ===

impl Shared {
    /// OK without a limit for every descriptor, counted under one series
    /// for every unknown domain: clients choose the names.
    fn answer_unknown_domain(&self, request: &Request) -> Decision {
        let cost = request.cost();
        for descriptor in &request.descriptors {
            self.metrics.record_decision(
                metrics::UNKNOWN_DOMAIN,
                metrics::UNKNOWN_RULE,
                metrics::MetricResult::Ok,
                descriptor.hits_addend.unwrap_or(cost),
            );
        }
        Decision {
            overall: Code::Ok,
            statuses: vec![Status::ok_without_limit(); request.descriptors.len()],
            headers: Vec::new(),
        }
    }

    /// Logs (rate-limited) a check whose cost exceeds its limit's capacity.
    fn warn_never_pass(&self, request: &Request, plan: &Plan) {
        for (idx, check) in plan.checks.iter().enumerate() {
            let capacity = check.check.params.capacity();
            if check.check.cost > capacity
                && let Some(suppressed) = self.never_pass.admit()
            {
                tracing::warn!(
                    domain = %request.domain,
                    rule = %plan.check_rule(idx),
                    cost = check.check.cost,
                    capacity,
                    suppressed,
                    "cost exceeds the limit's capacity: this request can never pass"
                );
            }
        }
    }

    /// The denial of a request whose every counter is known full.
    fn known_over_limit(&self, rules: &Arc<RuleSet>, plan: &Plan) -> Option<Verdict> {
        let verdict = self.over_limit.as_ref()?.lookup(rules, &plan.checks)?;
        self.metrics.record_over_limit_cache_hit();
        Some(verdict)
    }

    /// The backend's verdict on the plan's checks, timed; one outcome per
    /// check, or a protocol error. Full counters are remembered; with
    /// `traced`, the call is recorded there for the caller's trace.
    async fn call_backend(
        &self,
        rules: &Arc<RuleSet>,
        plan: &Plan,
        call: Option<&CallContext>,
        traced: Option<&BackendCall>,
    ) -> Result<Verdict, backends::Error> {
        let sent_us = self.over_limit.as_ref().map(OverLimitCache::now_us);
        let wall = traced.map(|_| std::time::SystemTime::now());
        let started = Instant::now();
        let res = match call {
            Some(call) => self.backend.decide_within(&plan.checks, call).await,
            None => self.backend.decide(&plan.checks).await,
        };
        if !matches!(res, Err(backends::Error::Deadline)) {
            self.backend_metrics.observe_latency(started.elapsed());
            if let (Some(traced), Some(wall)) = (traced, wall) {
                traced.record(BackendCallTimes {
                    backend: self.backend.name(),
                    started: wall,
                    took: started.elapsed(),
                    error: res.as_ref().err().map(ToString::to_string),
                });
            }
        }
        let verdict = res?;
        if verdict.outcomes.len() != plan.checks.len() {
            return Err(backends::Error::Protocol(format!(
                "{} outcomes for {} checks",
                verdict.outcomes.len(),
                plan.checks.len()
            )));
        }
        if let (Some(cache), Some(sent_us)) = (&self.over_limit, sent_us)
            && !verdict.allowed
        {
            cache.record(rules, &plan.checks, &verdict, sent_us);
            self.metrics.set_over_limit_cache_entries(cache.len());
        }
        Ok(verdict)
    }

    /// Counts (decisions, hits) the verdict of a call whose reply came
    /// after the backend's own timeout: its caller was answered through
    /// the failure mode, but Redis consumed what it decided.
    fn count_late(&self, rules: &RuleSet, domain: &str, plan: &Plan, verdict: &Verdict) {
        if verdict.outcomes.len() != plan.checks.len() {
            return;
        }
        if let Some(domain) = rules.domain(domain) {
            self.metrics.record_late_reply();
            let _ = self.answer(domain, plan, Some(verdict));
        }
    }

    /// Counts (decisions, hits) the verdict of a charge sent again after
    /// its caller's time (`resend`), like a late reply's.
    fn count_resent(&self, rules: &RuleSet, domain: &str, plan: &Plan, verdict: &Verdict) {
        if verdict.outcomes.len() != plan.checks.len() {
            return;
        }
        if let Some(domain) = rules.domain(domain) {
            self.metrics.record_charge_resent();
            let _ = self.answer(domain, plan, Some(verdict));
        }
    }

    fn on_backend_error(&self, plan: &Plan, error: backends::Error) -> Result<Decision, Error> {
        self.record_backend_error(&error);
        self.failure_answer(plan, error)
    }

    /// Counts and logs (rate-limited) a failed backend call.
    fn record_backend_error(&self, error: &backends::Error) {
        self.backend_metrics.record_error(error);
        if let Some(suppressed) = self.backend_errors.admit() {
            tracing::error!(
                backend = self.backend.name(),
                failure_mode = ?self.options.failure_mode,
                suppressed,
                "backend failed: {error}"
            );
        }
    }

    /// No config yet, so no decision: `--failure-mode` answers for every
    /// descriptor, as for a backend that cannot be reached (with `error`,
    /// UNAVAILABLE: Envoy's `failure_mode_deny` decides).
    fn answer_without_config(&self, request: &Request) -> Result<Decision, Error> {
        let code = match self.options.failure_mode {
            FailureMode::Error => return Err(Error::NoConfig),
            FailureMode::Allow => Code::Ok,
            FailureMode::Deny => Code::OverLimit,
        };
        let status = Status {
            code,
            ..Status::ok_without_limit()
        };
        Ok(Decision {
            overall: self.shadowed(code),
            statuses: vec![status; request.descriptors.len()],
            headers: Vec::new(),
        })
    }

    /// The answer through `--failure-mode` when no decision could be had.
    fn failure_answer(&self, plan: &Plan, error: backends::Error) -> Result<Decision, Error> {
        let code = match self.options.failure_mode {
            FailureMode::Error => return Err(Error::Backend(error)),
            FailureMode::Allow => Code::Ok,
            FailureMode::Deny => Code::OverLimit,
        };
        Ok(Decision {
            overall: self.shadowed(code),
            statuses: answer::failure_statuses(plan, code),
            headers: Vec::new(),
        })
    }

    fn shadowed(&self, code: Code) -> Code {
        if self.options.shadow_mode {
            Code::Ok
        } else {
            code
        }
    }
}

#[cfg(test)]
mod tests;
