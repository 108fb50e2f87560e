//! The nftables rulesets: one in each sandbox's namespace (its NAT and egress policy),
//! one in the host's (what crosses between sandboxes, the host and the world).
//!
//! A sandbox's namespace, `inet forkd`:
//! - `forward` (policy drop): replies pass; new traffic from the guest's tap to the
//!   uplink goes through `egress`; nothing enters the guest unasked.
//! - `egress`: the sandbox's [`EgressPolicy`], replaced whole when it changes.
//! - `input` (policy drop): the namespace itself answers nothing from outside.
//! - `postrouting`: the guest's address (the same in every child of a snapshot) is
//!   masqueraded as the namespace's own uplink address, which is unique.
//!
//! - `closed`: the networks no sandbox reaches ([`super::closed`]), jumped to first
//!   from `egress`.
//!
//! The host, `inet forkd`: traffic from one sandbox's link to another's is dropped, a
//! sandbox's new connections to the host itself are dropped, traffic into a sandbox
//! passes only as replies, what a sandbox sends to a closed network is dropped (the
//! host's `closed` chain, applied again when the host's routes change), and sandboxes'
//! uplink addresses are masqueraded on the way out.

use super::closed::ClosedNetworks;
use super::policy::{EgressMode, EgressPolicy, Network};
use super::{GATEWAY_ADDR, GUEST_LINK, HOST_LINK_PREFIX, UPLINK, UPLINK_RANGE};
use nftables::batch::Batch;
use nftables::expr::{
    Elem, Expression, Meta, MetaKey, NamedExpression, Payload, PayloadField, Prefix,
};
use nftables::schema::{
    Chain, Element, FlushObject, NfCmd, NfListObject, Nftables, Rule, Set, SetFlag, SetType,
    SetTypeValue, Table,
};
use nftables::stmt::{Match, Operator, Statement};
use nftables::types::{NfChainPolicy, NfChainType, NfFamily, NfHook};
use std::borrow::Cow;

/// The table forkd owns, in the host's namespace and in each sandbox's.
pub const TABLE: &str = "forkd";

/// The chain holding a sandbox's egress policy.
const EGRESS: &str = "egress";

/// The chain that drops what goes to a closed network (see [`super::closed`]), in a
/// sandbox's namespace and in the host's.
const CLOSED: &str = "closed";

/// The addresses the sandbox's resolver answered for names let out on every port.
const RESOLVED: &str = "resolved";

/// The (address, port) pairs it answered for names let out on some ports.
const RESOLVED_PORTS: &str = "resolved_ports";

/// The resolver's address and port in the namespace: what the guest may reach of the
/// namespace itself.
fn resolver_rule(proto: &'static str) -> NfListObject<'static> {
    rule(
        "input",
        vec![
            eq(meta(MetaKey::Iifname), string(GUEST_LINK)),
            eq(payload("ip", "daddr"), string(&GATEWAY_ADDR.to_string())),
            eq(payload(proto, "dport"), Expression::Number(53)),
            accept(),
        ],
    )
}

fn resolved_set(name: &'static str, kind: SetTypeValue<'static>) -> Set<'static> {
    Set {
        family: NfFamily::INet,
        table: TABLE.into(),
        name: name.into(),
        set_type: kind,
        flags: Some([SetFlag::Timeout].into_iter().collect()),
        ..Set::default()
    }
}

fn resolved_sets() -> [Set<'static>; 2] {
    [
        resolved_set(RESOLVED, SetTypeValue::Single(SetType::Ipv4Addr)),
        resolved_set(
            RESOLVED_PORTS,
            SetTypeValue::Concatenated(Cow::Owned(vec![SetType::Ipv4Addr, SetType::InetService])),
        ),
    ]
}

/// Lets out `addrs`, which the resolver answered with, for `ttl` seconds: on every port
/// if `ports` is empty, else on those.
pub fn let_out(addrs: &[std::net::Ipv4Addr], ports: &[u16], ttl: u32) -> Nftables<'static> {
    let elem = |val: Expression<'static>| {
        Expression::Named(NamedExpression::Elem(Elem {
            val: Box::new(val),
            timeout: Some(ttl),
            ..Elem::default()
        }))
    };
    let (set, elems): (&str, Vec<Expression<'static>>) = if ports.is_empty() {
        (
            RESOLVED,
            addrs.iter().map(|a| elem(string(&a.to_string()))).collect(),
        )
    } else {
        (
            RESOLVED_PORTS,
            addrs
                .iter()
                .flat_map(|a| {
                    ports.iter().map(move |p| {
                        elem(Expression::Named(NamedExpression::Concat(vec![
                            string(&a.to_string()),
                            Expression::Number((*p).into()),
                        ])))
                    })
                })
                .collect(),
        )
    };
    let mut batch = Batch::new();
    batch.add(NfListObject::Element(Element {
        family: NfFamily::INet,
        table: TABLE.into(),
        name: set.to_owned().into(),
        elem: Cow::Owned(elems),
    }));
    batch.to_nftables()
}

/// The ruleset a sandbox's namespace starts with: NAT, the fixed chains, and `policy`.
pub fn sandbox(policy: &EgressPolicy) -> Nftables<'static> {
    let mut batch = Batch::new();
    batch.add(NfListObject::Table(table()));
    batch.add(NfListObject::Chain(base_chain(
        "forward",
        NfChainType::Filter,
        NfHook::Forward,
        0,
        NfChainPolicy::Drop,
    )));
    batch.add(NfListObject::Chain(base_chain(
        "input",
        NfChainType::Filter,
        NfHook::Input,
        0,
        NfChainPolicy::Drop,
    )));
    batch.add(NfListObject::Chain(base_chain(
        "postrouting",
        NfChainType::NAT,
        NfHook::Postrouting,
        100,
        NfChainPolicy::Accept,
    )));
    batch.add(NfListObject::Chain(chain(EGRESS)));
    batch.add(NfListObject::Chain(chain(CLOSED)));
    for r in closed_rules(&super::closed::current()) {
        batch.add(r);
    }
    for set in resolved_sets() {
        batch.add(NfListObject::Set(Box::new(set)));
    }
    batch.add(rule("forward", vec![replies(), accept()]));
    batch.add(rule(
        "forward",
        vec![
            eq(meta(MetaKey::Iifname), string(GUEST_LINK)),
            eq(meta(MetaKey::Oifname), string(UPLINK)),
            eq(meta(MetaKey::Nfproto), string("ipv4")),
            jump(EGRESS),
        ],
    ));
    batch.add(rule(
        "input",
        vec![eq(meta(MetaKey::Iifname), string("lo")), accept()],
    ));
    batch.add(rule("input", vec![replies(), accept()]));
    batch.add(resolver_rule("udp"));
    batch.add(resolver_rule("tcp"));
    batch.add(rule(
        "postrouting",
        vec![
            eq(meta(MetaKey::Oifname), string(UPLINK)),
            Statement::Masquerade(None),
        ],
    ));
    for r in egress_rules(policy) {
        batch.add(r);
    }
    batch.to_nftables()
}

/// Replaces a running sandbox's egress policy in one transaction, and its closed
/// networks with this process's (a namespace made by an older daemon may hold others).
pub fn replace_egress(policy: &EgressPolicy) -> Nftables<'static> {
    let mut batch = Batch::new();
    batch.add(NfListObject::Chain(chain(CLOSED)));
    batch.add_cmd(NfCmd::Flush(FlushObject::Chain(chain(CLOSED))));
    for r in closed_rules(&super::closed::current()) {
        batch.add(r);
    }
    batch.add_cmd(NfCmd::Flush(FlushObject::Chain(chain(EGRESS))));
    // What was let out for names of the old policy goes with it.
    for set in resolved_sets() {
        batch.add_cmd(NfCmd::Flush(FlushObject::Set(Box::new(set))));
    }
    for r in egress_rules(policy) {
        batch.add(r);
    }
    batch.to_nftables()
}

/// The host's ruleset. Applied whole each time (add, flush, fill), so that every
/// daemon on the host leaves the same rules behind: its `closed` chain lets through
/// what any live daemon opened ([`super::closed::on_host`]).
pub fn host() -> Nftables<'static> {
    let mut batch = Batch::new();
    batch.add(NfListObject::Table(table()));
    batch.add_cmd(NfCmd::Flush(FlushObject::Table(table())));
    for (name, kind, hook, prio) in [
        ("forward", NfChainType::Filter, NfHook::Forward, 0),
        ("input", NfChainType::Filter, NfHook::Input, 0),
        ("postrouting", NfChainType::NAT, NfHook::Postrouting, 100),
    ] {
        batch.add(NfListObject::Chain(base_chain(
            name,
            kind,
            hook,
            prio,
            NfChainPolicy::Accept,
        )));
    }
    let sandbox_link = || string(&format!("{HOST_LINK_PREFIX}*"));
    batch.add(rule(
        "forward",
        vec![
            eq(meta(MetaKey::Iifname), sandbox_link()),
            eq(meta(MetaKey::Oifname), sandbox_link()),
            drop(),
        ],
    ));
    batch.add(rule(
        "forward",
        vec![
            eq(meta(MetaKey::Oifname), sandbox_link()),
            replies(),
            accept(),
        ],
    ));
    batch.add(rule(
        "forward",
        vec![eq(meta(MetaKey::Oifname), sandbox_link()), drop()],
    ));
    // Closed networks again, here where they follow the host's routes as they change.
    batch.add(NfListObject::Chain(chain(CLOSED)));
    for r in closed_rules(&super::closed::on_host()) {
        batch.add(r);
    }
    batch.add(rule(
        "forward",
        vec![eq(meta(MetaKey::Iifname), sandbox_link()), jump(CLOSED)],
    ));
    batch.add(rule(
        "forward",
        vec![eq(meta(MetaKey::Iifname), sandbox_link()), accept()],
    ));
    batch.add(rule(
        "input",
        vec![
            eq(meta(MetaKey::Iifname), sandbox_link()),
            replies(),
            accept(),
        ],
    ));
    batch.add(rule(
        "input",
        vec![eq(meta(MetaKey::Iifname), sandbox_link()), drop()],
    ));
    let (range, len) = UPLINK_RANGE;
    batch.add(rule(
        "postrouting",
        vec![
            eq(
                payload("ip", "saddr"),
                network(&Network {
                    addr: range,
                    prefix: len,
                    port: None,
                }),
            ),
            Statement::Match(Match {
                left: meta(MetaKey::Oifname),
                right: sandbox_link(),
                op: Operator::NEQ,
            }),
            Statement::Masquerade(None),
        ],
    ));
    batch.to_nftables()
}

/// The rules of the `egress` chain. What falls through returns to `forward`, whose
/// policy drops it.
fn egress_rules(policy: &EgressPolicy) -> Vec<NfListObject<'static>> {
    let mut rules = Vec::new();
    if policy.egress == EgressMode::Off {
        rules.push(rule(EGRESS, vec![drop()]));
        return rules;
    }
    // Closed networks first: no list opens them.
    rules.push(rule(EGRESS, vec![jump(CLOSED)]));
    // Listed destinations win over the deny-list (as E2B's allowOut over denyOut).
    for d in policy.allowed_networks() {
        rules.push(rule(EGRESS, to(d, accept())));
    }
    match policy.egress {
        EgressMode::Deny => {
            // What the resolver answered for allowed names (open addresses only: the
            // closed networks were dropped above, whatever a name resolves to).
            rules.push(rule(
                EGRESS,
                vec![
                    eq(payload("ip", "daddr"), string(&format!("@{RESOLVED}"))),
                    accept(),
                ],
            ));
            rules.push(rule(
                EGRESS,
                vec![
                    l4_tcp_or_udp(),
                    eq(
                        Expression::Named(NamedExpression::Concat(vec![
                            payload("ip", "daddr"),
                            payload("th", "dport"),
                        ])),
                        string(&format!("@{RESOLVED_PORTS}")),
                    ),
                    accept(),
                ],
            ));
        }
        EgressMode::Allow => {
            for d in policy.denied_networks() {
                rules.push(rule(EGRESS, to(d, drop())));
            }
            rules.push(rule(EGRESS, vec![accept()]));
        }
        EgressMode::Off => unreachable!("handled above"),
    }
    rules
}

/// The `closed` chain: what the operator opened returns to the caller, then every
/// closed network is dropped.
fn closed_rules(closed: &ClosedNetworks) -> Vec<NfListObject<'static>> {
    let opened = closed
        .opened()
        .iter()
        .map(|d| to(d, Statement::Return(None)));
    let shut = closed.networks();
    let shut = shut.iter().map(|d| to(d, drop()));
    opened.chain(shut).map(|r| rule(CLOSED, r)).collect()
}

fn jump(target: &'static str) -> Statement<'static> {
    Statement::Jump(nftables::stmt::JumpTarget {
        target: target.into(),
    })
}

/// `ip daddr D [meta l4proto {tcp, udp} th dport P] VERDICT`.
fn to(d: &Network, verdict: Statement<'static>) -> Vec<Statement<'static>> {
    let mut stmts = Vec::new();
    if d.prefix > 0 {
        stmts.push(eq(payload("ip", "daddr"), network(d)));
    }
    if let Some(port) = d.port {
        stmts.push(l4_tcp_or_udp());
        stmts.push(eq(payload("th", "dport"), Expression::Number(port.into())));
    }
    stmts.push(verdict);
    stmts
}

/// `meta l4proto { tcp, udp }`: what makes `th dport` mean a port.
fn l4_tcp_or_udp() -> Statement<'static> {
    eq(
        meta(MetaKey::L4proto),
        Expression::Named(NamedExpression::Set(vec![
            nftables::expr::SetItem::Element(string("tcp")),
            nftables::expr::SetItem::Element(string("udp")),
        ])),
    )
}

fn network(d: &Network) -> Expression<'static> {
    let addr = string(&d.addr.to_string());
    if d.prefix == 32 {
        addr
    } else {
        Expression::Named(NamedExpression::Prefix(Prefix {
            addr: Box::new(addr),
            len: d.prefix.into(),
        }))
    }
}

fn table() -> Table<'static> {
    Table {
        family: NfFamily::INet,
        name: TABLE.into(),
        ..Table::default()
    }
}

fn chain(name: &'static str) -> Chain<'static> {
    Chain {
        family: NfFamily::INet,
        table: TABLE.into(),
        name: name.into(),
        ..Chain::default()
    }
}

fn base_chain(
    name: &'static str,
    kind: NfChainType,
    hook: NfHook,
    prio: i32,
    policy: NfChainPolicy,
) -> Chain<'static> {
    Chain {
        _type: Some(kind),
        hook: Some(hook),
        prio: Some(prio),
        policy: Some(policy),
        ..chain(name)
    }
}

fn rule(chain: &'static str, stmts: Vec<Statement<'static>>) -> NfListObject<'static> {
    NfListObject::Rule(Rule {
        family: NfFamily::INet,
        table: TABLE.into(),
        chain: chain.into(),
        expr: Cow::Owned(stmts),
        ..Rule::default()
    })
}

fn meta(key: MetaKey) -> Expression<'static> {
    Expression::Named(NamedExpression::Meta(Meta { key }))
}

fn payload(protocol: &'static str, field: &'static str) -> Expression<'static> {
    Expression::Named(NamedExpression::Payload(Payload::PayloadField(
        PayloadField {
            protocol: protocol.into(),
            field: field.into(),
        },
    )))
}

fn string(s: &str) -> Expression<'static> {
    Expression::String(Cow::Owned(s.to_owned()))
}

fn eq(left: Expression<'static>, right: Expression<'static>) -> Statement<'static> {
    Statement::Match(Match {
        left,
        right,
        op: Operator::EQ,
    })
}

/// `ct state established,related`.
fn replies() -> Statement<'static> {
    Statement::Match(Match {
        left: Expression::Named(NamedExpression::CT(nftables::expr::CT {
            key: "state".into(),
            family: None,
            dir: None,
        })),
        right: Expression::List(vec![string("established"), string("related")]),
        op: Operator::IN,
    })
}

fn accept() -> Statement<'static> {
    Statement::Accept(None)
}

fn drop() -> Statement<'static> {
    Statement::Drop(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(n: &Nftables) -> String {
        serde_json::to_string(n).unwrap()
    }

    #[test]
    fn closed_networks_are_dropped_before_any_list_lets_something_through() {
        let policy: EgressPolicy =
            serde_json::from_str(r#"{"allow":["10.9.8.7:80","8.8.0.0/16"]}"#).unwrap();
        let rules = egress_rules(&policy);
        let text: Vec<String> = rules
            .iter()
            .map(|r| serde_json::to_string(r).unwrap())
            .collect();
        let closed = text.iter().position(|r| r.contains("\"closed\"")).unwrap();
        assert_eq!(closed, 0, "{text:#?}");
        let listed = text.iter().position(|r| r.contains("8.8.0.0")).unwrap();
        let private = text.iter().position(|r| r.contains("10.9.8.7")).unwrap();
        let resolved = text.iter().position(|r| r.contains("@resolved")).unwrap();
        assert!(closed < listed && closed < private && closed < resolved);
        assert!(text[private].contains("\"dport\"") && text[private].contains("80"));
        // In deny mode, nothing is accepted without a destination.
        assert!(
            text.iter()
                .filter(|r| r.contains("accept"))
                .all(|r| r.contains("daddr")),
            "{text:#?}"
        );
    }

    #[test]
    fn the_closed_chain_returns_what_is_opened_and_drops_every_closed_network() {
        let n = |s: &str| {
            *s.parse::<super::super::policy::Destination>()
                .unwrap()
                .network()
                .unwrap()
        };
        let closed = ClosedNetworks::new(vec![n("5.3.5.0/24")], vec![n("10.252.77.0/24")]);
        let text: Vec<String> = closed_rules(&closed)
            .iter()
            .map(|r| serde_json::to_string(r).unwrap())
            .collect();
        assert!(text[0].contains("10.252.77.0") && text[0].contains("return"));
        let drops = &text[1..];
        assert_eq!(drops.len(), super::super::closed::SPECIAL_PURPOSE.len() + 1);
        assert!(drops.iter().all(|r| r.contains("drop")));
        for net in ["\"203.0.113.0\"", "\"198.18.0.0\"", "\"5.3.5.0\""] {
            assert!(drops.iter().any(|r| r.contains(net)), "{net}: {drops:#?}");
        }
        // The host jumps there for every sandbox link before it lets one out.
        let forward: Vec<String> = host()
            .objects
            .iter()
            .map(|o| serde_json::to_string(o).unwrap())
            .filter(|r| r.contains("\"rule\"") && r.contains("\"chain\":\"forward\""))
            .collect();
        let jump = forward.iter().position(|r| r.contains("\"jump\"")).unwrap();
        let out = forward
            .iter()
            .position(|r| r.contains("\"accept\"") && !r.contains("\"ct\""))
            .unwrap();
        assert!(jump < out, "{forward:#?}");
        // And a change of policy refills the namespace's closed chain too.
        let replaced = json(&replace_egress(&EgressPolicy::default()));
        assert!(replaced.contains("\"closed\"") && replaced.contains("203.0.113.0"));
    }

    #[test]
    fn allow_mode_ends_in_accept_and_off_in_drop() {
        let allow: EgressPolicy =
            serde_json::from_str(r#"{"egress":"allow","deny":["198.51.100.0/24"]}"#).unwrap();
        let rules = egress_rules(&allow);
        let last = serde_json::to_string(rules.last().unwrap()).unwrap();
        assert!(last.contains("accept") && !last.contains("daddr"), "{last}");
        let off = EgressPolicy {
            egress: EgressMode::Off,
            ..EgressPolicy::default()
        };
        let rules = egress_rules(&off);
        assert_eq!(rules.len(), 1);
        assert!(serde_json::to_string(&rules[0]).unwrap().contains("drop"));
    }

    #[test]
    fn rulesets_serialize() {
        assert!(json(&sandbox(&EgressPolicy::default())).contains("masquerade"));
        assert!(json(&host()).contains(&format!("{HOST_LINK_PREFIX}*")));
        assert!(json(&replace_egress(&EgressPolicy::default())).contains("flush"));
    }
}
