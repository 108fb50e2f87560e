// E2B's JavaScript SDKs without E2B_SANDBOX_URL: they reach each sandbox at
// https://<port>-<id>.<domain>, the domain the create call returned, and forkd routes by
// that host name. The names resolve through FORKD_HOSTS (bind-mounted over /etc/hosts
// by the test), where each new sandbox's names are added once its id is known, as a
// wildcard DNS record would answer them. Prints `ok`.

import assert from 'node:assert/strict'
import { appendFileSync } from 'node:fs'
import { Sandbox } from 'e2b'
import { Sandbox as CodeInterpreter } from '@e2b/code-interpreter'

assert.equal(process.env.E2B_SANDBOX_URL, undefined)
const template = process.env.FORKD_TEST_SNAPSHOT
const resolve = (s) =>
  appendFileSync(
    process.env.FORKD_HOSTS,
    `${process.env.FORKD_E2B_ADDR} 49983-${s.sandboxId}.${s.sandboxDomain} 49999-${s.sandboxId}.${s.sandboxDomain}\n`,
  )

const sbx = await Sandbox.create(template)
assert.equal(sbx.sandboxDomain, process.env.FORKD_E2B_DOMAIN)
resolve(sbx)
assert.equal((await sbx.commands.run('echo routed by host')).stdout, 'routed by host\n')
await sbx.files.write('/tmp/tls.txt', 'over TLS')
assert.equal(await sbx.files.read('/tmp/tls.txt'), 'over TLS')
await sbx.kill()

const ci = await CodeInterpreter.create(template)
resolve(ci)
try {
  assert.equal((await ci.runCode('6 * 7')).text, '42')
} finally {
  await ci.kill()
}
console.log('ok')
