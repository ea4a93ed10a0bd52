{{/*
Chart name, truncated to the 63 characters of a DNS label.
*/}}
{{- define "receipts.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: "<release>-<chart>", or the release name when it already contains the chart
name. At most 52 characters (a CronJob's limit; other names add suffixes within their own
limits, receipts.componentName): a longer one keeps 45 characters and the first 6 hex digits
of the whole name's SHA-256, so two long release names sharing a prefix stay apart.
*/}}
{{- define "receipts.fullname" -}}
{{- $full := "" }}
{{- if .Values.fullnameOverride }}
{{- $full = .Values.fullnameOverride }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- $full = .Release.Name }}
{{- else }}
{{- $full = printf "%s-%s" .Release.Name $name }}
{{- end }}
{{- end }}
{{- if gt (len $full) 52 }}
{{- $full = printf "%s-%s" ($full | trunc 45 | trimSuffix "-") (sha256sum $full | trunc 6) }}
{{- end }}
{{- $full }}
{{- end }}

{{/*
Name of one of the release's objects: "<fullname>-<suffix>", at most .max characters (a
CronJob's name 52, as Kubernetes appends 11 characters for its Jobs; a Job's, Service's or
Pod's 63, the DNS label a Job's name becomes in its pods' job-name label). When it would be
longer, the full name is truncated and the first 6 hex digits of its SHA-256 keep two long
release names that share a prefix apart. Pass a dict with "ctx" (root), "suffix", "max".
*/}}
{{- define "receipts.componentName" -}}
{{- $full := include "receipts.fullname" .ctx -}}
{{- $name := printf "%s-%s" $full .suffix -}}
{{- if gt (len $name) (int .max) -}}
{{- $keep := sub (sub (int .max) (len .suffix)) 8 | int -}}
{{- $name = printf "%s-%s-%s" ($full | trunc $keep | trimSuffix "-") (sha256sum $full | trunc 6) .suffix -}}
{{- end -}}
{{- $name -}}
{{- end }}

{{/* The recovery CronJob's name (at most 52 characters). */}}
{{- define "receipts.recoveryName" -}}
{{- include "receipts.componentName" (dict "ctx" . "suffix" "recovery" "max" 52) -}}
{{- end }}

{{/*
API versions of the kinds whose stable version came after the oldest Kubernetes the chart
supports (1.20), chosen from the cluster's version (.Capabilities.KubeVersion: the live
cluster's on install, --kube-version with `helm template`) as community charts do: the
stable one from the release that made it stable (CronJob batch/v1 in 1.21, PodDisruptionBudget
policy/v1 in 1.21, HorizontalPodAutoscaler autoscaling/v2 in 1.23), the beta before. Each
beta serves the same fields the chart renders.
*/}}
{{- define "receipts.cronJobApiVersion" -}}
{{- ternary "batch/v1" "batch/v1beta1" (semverCompare ">=1.21.0-0" .Capabilities.KubeVersion.Version) -}}
{{- end }}

{{- define "receipts.pdbApiVersion" -}}
{{- ternary "policy/v1" "policy/v1beta1" (semverCompare ">=1.21.0-0" .Capabilities.KubeVersion.Version) -}}
{{- end }}

{{- define "receipts.hpaApiVersion" -}}
{{- ternary "autoscaling/v2" "autoscaling/v2beta2" (semverCompare ">=1.23.0-0" .Capabilities.KubeVersion.Version) -}}
{{- end }}

{{/*
A Kubernetes quantity ("128Mi", "1G", "100m", "0.5", 2) as a plain number (bytes, cores),
for comparing a request with its limit: the binary suffixes Ki..Ei, the decimal k..E and
m (milli). A suffix it does not know gives -1, which no check acts on.
*/}}
{{- define "receipts.quantity" -}}
{{- $q := toString . | trim -}}
{{- $num := regexFind "^[0-9]*\\.?[0-9]+" $q -}}
{{- $unit := trimPrefix $num $q -}}
{{- $mult := dict "" 1.0 "m" 0.001 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 -}}
{{- if and $num (hasKey $mult $unit) -}}
{{- mulf ($num | float64) (get $mult $unit) -}}
{{- else -}}
-1
{{- end -}}
{{- end }}

{{- define "receipts.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels: frozen (a Deployment's selector cannot change after install).
*/}}
{{- define "receipts.selectorLabels" -}}
app.kubernetes.io/name: {{ include "receipts.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Labels for every object; pass a dict with "ctx" (the root context) and, for objects of one
component (worker, recovery, migration, dashboard), "component". Objects several
components share (ConfigMap, Secret, ServiceAccount, alert rules) carry no component label.
*/}}
{{- define "receipts.labels" -}}
helm.sh/chart: {{ include "receipts.chart" .ctx }}
{{ include "receipts.selectorLabels" .ctx }}
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
app.kubernetes.io/part-of: receipts
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Selector labels of the worker pods.
*/}}
{{- define "receipts.workerSelectorLabels" -}}
{{ include "receipts.selectorLabels" . }}
app.kubernetes.io/component: worker
{{- end }}

{{- define "receipts.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "receipts.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "receipts.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
Name of the Secret holding RECEIPTS_DATABASE_URL and RECEIPTS_PROVIDER_TOKEN.
*/}}
{{- define "receipts.secretName" -}}
{{- default (include "receipts.fullname" .) .Values.secret.existingSecret }}
{{- end }}

{{/*
Secret environment variables (from the Secret, never from the ConfigMap).
Pass a dict with "ctx" (root) and "secretName".
*/}}
{{- define "receipts.secretEnv" -}}
- name: RECEIPTS_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ .secretName }}
      key: {{ .ctx.Values.secret.databaseUrlKey }}
- name: RECEIPTS_PROVIDER_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .secretName }}
      key: {{ .ctx.Values.secret.providerTokenKey }}
      optional: true
{{- end }}

{{/*
Non-secret settings as a map NAME: "value" (the ConfigMap data, and the migration hook's
inline env, which runs before the ConfigMap exists): the chart's own, then config.extraEnv.
*/}}
{{- define "receipts.configData" -}}
{{ include "receipts.chartConfigData" . }}
{{- range $k, $v := .Values.config.extraEnv }}
{{ $k }}: {{ $v | toString | quote }}
{{- end }}
{{- end }}

{{/*
The settings the chart sets from its config values.
*/}}
{{- define "receipts.chartConfigData" -}}
{{- $c := .Values.config -}}
RECEIPTS_PROVIDER_URL: {{ $c.providerUrl | quote }}
RECEIPTS_CONCURRENCY: {{ $c.concurrency | int | quote }}
RECEIPTS_LEASE_SECONDS: {{ $c.leaseSeconds | int | quote }}
RECEIPTS_LEASE_MARGIN_SECONDS: {{ $c.leaseMarginSeconds | int | quote }}
RECEIPTS_MAX_ATTEMPTS: {{ $c.maxAttempts | int | quote }}
RECEIPTS_DELIVERY_TIMEOUT_SECONDS: {{ $c.deliveryTimeoutSeconds | toString | quote }}
RECEIPTS_POLL_INTERVAL_SECONDS: {{ $c.pollIntervalSeconds | toString | quote }}
RECEIPTS_CLAIM_BATCH_MAX: {{ $c.claimBatchMax | int | quote }}
RECEIPTS_METRICS_PORT: {{ .Values.metrics.port | int | quote }}
RECEIPTS_LOG_LEVEL: {{ $c.logLevel | quote }}
RECEIPTS_ADAPTIVE_CONCURRENCY: {{ $c.adaptiveConcurrency | toString | quote }}
RECEIPTS_ADAPTIVE_CONCURRENCY_FLOOR: {{ $c.adaptiveConcurrencyFloor | int | quote }}
RECEIPTS_ADAPTIVE_CONCURRENCY_CEILING: {{ $c.adaptiveConcurrencyCeiling | int | quote }}
RECEIPTS_POOL_MAX_SIZE: {{ $c.poolMaxSize | int | quote }}
RECEIPTS_LISTEN_NOTIFY: {{ and $c.listenNotify (not $c.pgbouncer) | toString | quote }}
RECEIPTS_PGBOUNCER: {{ $c.pgbouncer | toString | quote }}
{{- with $c.databaseSchema }}
RECEIPTS_DATABASE_SCHEMA: {{ . | quote }}
{{- end }}
RECEIPTS_SHUTDOWN_GRACE_SECONDS: {{ $c.shutdownGraceSeconds | toString | quote }}
RECEIPTS_RETRY_BASE_SECONDS: {{ $c.retryBaseSeconds | toString | quote }}
RECEIPTS_RETRY_CAP_SECONDS: {{ $c.retryCapSeconds | toString | quote }}
RECEIPTS_RETENTION_DAYS: {{ $c.retentionDays | int | quote }}
RECEIPTS_QUEUE_STATS_INTERVAL_SECONDS: {{ $c.queueStatsIntervalSeconds | toString | quote }}
RECEIPTS_STATEMENT_TIMEOUT_SECONDS: {{ $c.statementTimeoutSeconds | toString | quote }}
RECEIPTS_LOCK_TIMEOUT_SECONDS: {{ $c.lockTimeoutSeconds | toString | quote }}
{{- with $c.pushgatewayUrl }}
RECEIPTS_PUSHGATEWAY_URL: {{ . | quote }}
{{- end }}
{{- with .Values.proxy.providerProxy }}
RECEIPTS_PROVIDER_PROXY: {{ . | quote }}
{{- end }}
{{- with .Values.proxy.httpsProxy }}
HTTPS_PROXY: {{ . | quote }}
{{- end }}
{{- with .Values.proxy.httpProxy }}
HTTP_PROXY: {{ . | quote }}
{{- end }}
{{- with .Values.proxy.noProxy }}
NO_PROXY: {{ . | quote }}
{{- end }}
{{- end }}

{{/*
Most worker pods the autoscaler (or the fixed replica count) asks for.
*/}}
{{- define "receipts.maxReplicas" -}}
{{- if .Values.autoscaling.enabled }}{{ .Values.autoscaling.maxReplicas | int }}{{ else }}{{ .Values.worker.replicaCount | int }}{{ end }}
{{- end }}

{{/*
An int-or-percent value (maxSurge, maxUnavailable) as pods out of "replicas", rounded up
(the worst case for the connection budget). Pass a dict with "value" and "replicas".
*/}}
{{- define "receipts.podsOf" -}}
{{- $v := toString .value -}}
{{- if hasSuffix "%" $v -}}
{{- div (add (mul ($v | trimSuffix "%" | int) (.replicas | int)) 99) 100 -}}
{{- else -}}
{{- $v | int -}}
{{- end -}}
{{- end }}

{{/*
Connection budget arithmetic, as a dict of ints (JSON). Worker pods beyond maxReplicas:
a rollout adds up to maxSurge new pods while up to maxUnavailable old ones still drain
(a terminating pod keeps its connections until it exits, and the Deployment does not wait
for it before starting the replacement); a voluntary eviction likewise starts a
replacement while the evicted pod drains, at most podDisruptionBudget.maxUnavailable at
once. The surge is maxSurge + the larger of the two.
*/}}
{{- define "receipts.connections" -}}
{{- $c := .Values.config -}}
{{- $listener := ternary 1 0 (and $c.listenNotify (not $c.pgbouncer)) -}}
{{- $perPod := add ($c.poolMaxSize | int) $listener -}}
{{- $replicas := include "receipts.maxReplicas" . | int -}}
{{- $maxSurge := include "receipts.podsOf" (dict "value" .Values.worker.maxSurge "replicas" $replicas) | int -}}
{{- $draining := include "receipts.podsOf" (dict "value" .Values.worker.maxUnavailable "replicas" $replicas) | int -}}
{{- if .Values.podDisruptionBudget.enabled }}
{{- $draining = max $draining (include "receipts.podsOf" (dict "value" .Values.podDisruptionBudget.maxUnavailable "replicas" $replicas) | int) -}}
{{- end }}
{{- $surge := add $maxSurge $draining -}}
{{- $recovery := ternary 1 0 .Values.recovery.enabled -}}
{{- $migration := ternary 1 0 .Values.migration.enabled -}}
{{- $keda := ternary 1 0 (and .Values.autoscaling.enabled .Values.autoscaling.keda.enabled) -}}
{{- $reserved := .Values.connectionBudget.reserved | int -}}
{{- $ui := ternary (mul 2 (.Values.ui.replicas | int)) 0 .Values.ui.enabled -}}
{{- $total := add (mul (add $replicas $surge) $perPod) $recovery $migration $keda $reserved $ui -}}
{{- dict "replicas" $replicas "surge" $surge "pool" ($c.poolMaxSize | int) "listener" $listener "perPod" $perPod "recovery" $recovery "migration" $migration "keda" $keda "reserved" $reserved "ui" $ui "total" $total "budget" (.Values.connectionBudget.maxConnections | int) | toJson }}
{{- end }}

{{/*
One line of connection arithmetic for messages and NOTES.txt.
*/}}
{{- define "receipts.connectionsLine" -}}
{{- $n := include "receipts.connections" . | fromJson -}}
{{- $ui := ternary (printf " + review page %d" (int $n.ui)) "" (gt (int $n.ui) 0) -}}
{{- printf "(%d max replicas + %d rollout surge) × %d per pod (pool %d + listener %d) + recovery %d + migration %d + KEDA %d + reserved %d%s = %d connections; budget %d" (int $n.replicas) (int $n.surge) (int $n.perPod) (int $n.pool) (int $n.listener) (int $n.recovery) (int $n.migration) (int $n.keda) (int $n.reserved) $ui (int $n.total) (int $n.budget) }}
{{- end }}

{{/*
The connection budget formula in words, for the fail message.
*/}}
{{- define "receipts.connectionsFormula" -}}
(maxReplicas + worker.maxSurge + max(worker.maxUnavailable, podDisruptionBudget.maxUnavailable)) × (config.poolMaxSize + 1 listener unless config.listenNotify=false or config.pgbouncer=true) + 1 recovery + 1 migration + 1 KEDA scaler (each when enabled) + connectionBudget.reserved must not exceed connectionBudget.maxConnections
{{- end }}

{{/*
The worker's stop budget in seconds (float), from the settings the chart renders; the same
formula as the worker's Settings.stop_budget_seconds: in-flight deliveries
min(grace, delivery timeout) + ack flush max(5, min(grace, 30)) + pool close 5.
*/}}
{{- define "receipts.stopBudgetSeconds" -}}
{{- $data := include "receipts.configData" . | fromYaml -}}
{{- $grace := $data.RECEIPTS_SHUTDOWN_GRACE_SECONDS | float64 -}}
{{- $timeout := $data.RECEIPTS_DELIVERY_TIMEOUT_SECONDS | float64 -}}
{{- addf (minf $grace $timeout) (maxf 5.0 (minf $grace 30.0)) 5.0 -}}
{{- end }}

{{/*
Seconds Kubernetes waits after SIGTERM when none is set: the stop budget rounded up, plus
5 s for the signal to arrive and the interpreter to exit.
*/}}
{{- define "receipts.minTerminationGracePeriodSeconds" -}}
{{- add (include "receipts.stopBudgetSeconds" . | float64 | ceil | int) 5 -}}
{{- end }}

{{- define "receipts.terminationGracePeriodSeconds" -}}
{{- if kindIs "invalid" .Values.worker.terminationGracePeriodSeconds }}
{{- include "receipts.minTerminationGracePeriodSeconds" . }}
{{- else }}
{{- .Values.worker.terminationGracePeriodSeconds | int }}
{{- end }}
{{- end }}

{{/*
KEDA's target per pod: the jobs (due or in flight) one pod should carry, its slots ×
autoscaling.keda.utilisation, at least 1.
*/}}
{{- define "receipts.kedaTarget" -}}
{{- max 1 (mulf (.Values.config.concurrency | float64) (.Values.autoscaling.keda.utilisation | float64) | floor | int) -}}
{{- end }}

{{/*
The scaling signal (one statement, served by the partial indexes receipt_jobs_ready and
receipt_jobs_expired): due, claimable ready jobs + running jobs whose lease is live.
While the fleet is paused (a receipt_flow row with a pause_reason) due jobs do not count:
running jobs count at the target's share of a pod, ceil(running × target / slots), so the
fleet keeps the pods that hold them and asks for no more, and at least 1 while jobs wait,
so one pod stays to see the pause end. Each count stops at maxReplicas × target: more
would not change KEDA's answer, and the statement's cost stays bounded by it. Tables are
qualified with config.databaseSchema when it is set (else KEDA's DSN's search_path applies).
With config.adaptiveConcurrency, while a live pod's adaptive limit (its receipt_workers row,
heard within 60 s) is below the most a pod may have in flight (most: the slots or
config.adaptiveConcurrencyCeiling, the smaller), the provider holds the fleet back: the value
is capped at (ceil(sum of the live pods' limits, each at most most, / most) +
autoscaling.keda.capacityHeadroomPods) × target, so KEDA asks for no more pods than the
limits can use plus the headroom, however deep the backlog. No live limits (an idle fleet,
scaled to zero, adaptation off in the pods): no cap.
*/}}
{{- define "receipts.kedaQuery" -}}
{{- $target := include "receipts.kedaTarget" . | int -}}
{{- $slots := .Values.config.concurrency | int -}}
{{- $cap := mul (.Values.autoscaling.maxReplicas | int) $target -}}
{{- $s := "" -}}
{{- with .Values.config.databaseSchema }}{{ $s = printf "%q." . }}{{ end -}}
WITH flow AS (
  SELECT EXISTS (SELECT FROM {{ $s }}receipt_flow WHERE pause_reason IS NOT NULL) AS paused
), due AS (
  SELECT count(*) AS n FROM (
    SELECT FROM {{ $s }}receipt_jobs
    WHERE state = 'ready' AND run_at <= statement_timestamp() AND attempts < {{ .Values.config.maxAttempts | int }}
    LIMIT CASE WHEN (SELECT paused FROM flow) THEN 1 ELSE {{ $cap }} END
  ) AS d
), busy AS (
  SELECT count(*) AS n FROM (
    SELECT FROM {{ $s }}receipt_jobs
    WHERE state = 'running' AND lease_until > statement_timestamp()
    LIMIT {{ $cap }}
  ) AS b
)
{{- if .Values.config.adaptiveConcurrency }}
{{- $most := min $slots (.Values.config.adaptiveConcurrencyCeiling | int) }}, fleet AS (
  SELECT sum(least(concurrency_limit, {{ $most }})) AS lim, bool_or(concurrency_limit < {{ $most }}) AS held
  FROM {{ $s }}receipt_workers
  WHERE seen_at > statement_timestamp() - interval '60 seconds' AND stopped_at IS NULL
    AND concurrency_limit IS NOT NULL
)
SELECT CASE WHEN flow.paused THEN greatest((busy.n * {{ $target }} + {{ sub $slots 1 }}) / {{ $slots }}, due.n)
            WHEN fleet.held THEN least(due.n + busy.n,
              (ceil(fleet.lim / {{ $most }}.0)::bigint + {{ .Values.autoscaling.keda.capacityHeadroomPods | int }}) * {{ $target }})
            ELSE due.n + busy.n END
FROM flow, due, busy, fleet
{{- else }}
SELECT CASE WHEN flow.paused THEN greatest((busy.n * {{ $target }} + {{ sub $slots 1 }}) / {{ $slots }}, due.n)
            ELSE due.n + busy.n END
FROM flow, due, busy
{{- end }}
{{- end }}

{{/*
The external-metric HPA's signal (autoscaling.hpa.metric external) in PromQL over the
workers' gauges, the KEDA query's counterpart: due ready jobs (receipts_ready_jobs, the
same on every pod: max) + deliveries in flight (summed over pods), by namespace and job.
Absent while the workers' queue statistics are stale (the HPA then holds). With
config.adaptiveConcurrency, while a live pod's limit (receipts_concurrency_limit, 0 while
adaptation is off in it) is below the most a pod may have in flight (most: the slots or
config.adaptiveConcurrencyCeiling, the smaller), the value is capped as KEDA's is, at
(ceil(sum of the live limits, each at most most, / most) + autoscaling.keda.capacityHeadroomPods)
× target: the HPA asks for no more pods than the limits can use plus the headroom, however
deep the backlog. A pod is live while Prometheus scrapes it (its series go stale when its
target goes). Pass a dict with "ctx" (root) and "matchers" (the label matchers, e.g.
job="receipts", or prometheus-adapter's <<.LabelMatchers>>).
*/}}
{{- define "receipts.externalMetricExpr" -}}
{{- $m := .matchers -}}
{{- $c := .ctx.Values.config -}}
{{- $due := printf "max by (namespace, job) (receipts_ready_jobs{%s})" $m -}}
{{- $sum := printf "%s\n+ sum by (namespace, job) (receipts_inflight_deliveries{%s})" $due $m -}}
{{- if $c.adaptiveConcurrency -}}
{{- $most := min ($c.concurrency | int) ($c.adaptiveConcurrencyCeiling | int) -}}
{{- $limit := printf "receipts_concurrency_limit{%s} > 0" $m -}}
min by (namespace, job) (
  label_replace(
    {{ $sum | nindent 4 | trim }},
    "bound", "jobs", "", "")
  or
  label_replace(
    (ceil(sum by (namespace, job) (clamp_max({{ $limit }}, {{ $most }})) / {{ $most }}) + {{ .ctx.Values.autoscaling.keda.capacityHeadroomPods | int }}) * {{ include "receipts.kedaTarget" .ctx }}
    and on (namespace, job) count by (namespace, job) ({{ $limit }} < {{ $most }})
    and on (namespace, job) {{ $due }},
    "bound", "capacity", "", "")
)
{{- else -}}
{{ $sum }}
{{- end -}}
{{- end }}

{{/*
Name of the series the recording rule of receipts.externalMetricRules records, which the
External metrics adapter serves as autoscaling.hpa.externalMetric.name.
*/}}
{{- define "receipts.externalMetricSeries" -}}
namespace_job:receipts_jobs_due_or_in_flight:capped
{{- end }}

{{/*
The recording rule group of the external-metric HPA, as rule-file groups (nothing unless
the chart renders that HPA): receipts.externalMetricExpr over this release's series
(receipts.alertSelector). The chart's PrometheusRule carries it, so a `helm upgrade`
that changes the slots, the utilisation, the ceiling or adaptation updates the cap.
*/}}
{{- define "receipts.externalMetricRules" -}}
{{- $a := .Values.autoscaling -}}
{{- if and $a.enabled (not $a.keda.enabled) (eq $a.hpa.metric "external") }}
- name: receipts-autoscaling
  rules:
    - record: {{ include "receipts.externalMetricSeries" . }}
      expr: |-
        {{- include "receipts.externalMetricExpr" (dict "ctx" . "matchers" (include "receipts.alertSelector" .)) | nindent 8 }}
{{- end }}
{{- end }}

{{/*
nodeSelector, tolerations and affinity of a pod. Pass a dict with "ctx" (root) and "pod"
(the component's values): a key left null there takes the worker's value.
*/}}
{{- define "receipts.scheduling" -}}
{{- $worker := .ctx.Values.worker -}}
{{- range $key := list "nodeSelector" "affinity" "tolerations" }}
{{- $value := index $.pod $key -}}
{{- if kindIs "invalid" $value }}{{ $value = index $worker $key }}{{ end }}
{{- with $value }}
{{ $key }}:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Checks of value combinations; included by every workload template, renders nothing.
*/}}
{{- define "receipts.validate" -}}
{{- include "receipts.validateInstall" . -}}
{{- $n := include "receipts.connections" . | fromJson -}}
{{- if gt (int $n.total) (int $n.budget) }}
{{- fail (printf "connection budget exceeded: %s. The rule: %s. Lower autoscaling.maxReplicas (or worker.replicaCount), worker.maxSurge or config.poolMaxSize, set config.listenNotify=false or config.pgbouncer=true, or raise connectionBudget.maxConnections." (include "receipts.connectionsLine" .) (include "receipts.connectionsFormula" .)) }}
{{- end }}
{{- if and (has (toString .Values.worker.maxSurge) (list "0" "0%")) (has (toString .Values.worker.maxUnavailable) (list "0" "0%")) }}
{{- fail "worker.maxSurge and worker.maxUnavailable cannot both be 0: a rollout could never replace a pod." }}
{{- end }}
{{- $c := .Values.config -}}
{{- $own := include "receipts.chartConfigData" . | fromYaml -}}
{{- range $key := keys $c.extraEnv | sortAlpha }}
{{- if hasKey $own $key }}
{{- fail (printf "config.extraEnv sets %s, which the chart already sets from its config values: set that value instead." $key) }}
{{- end }}
{{- end }}
{{- if gt (float64 $c.deliveryTimeoutSeconds) (float64 (sub ($c.leaseSeconds | int) ($c.leaseMarginSeconds | int))) }}
{{- fail (printf "config.deliveryTimeoutSeconds (%v) must be <= config.leaseSeconds (%v) - config.leaseMarginSeconds (%v): a delivery must end before its lease can expire." $c.deliveryTimeoutSeconds $c.leaseSeconds $c.leaseMarginSeconds) }}
{{- end }}
{{- $minGrace := include "receipts.minTerminationGracePeriodSeconds" . | int -}}
{{- if lt (include "receipts.terminationGracePeriodSeconds" . | int) $minGrace }}
{{- fail (printf "worker.terminationGracePeriodSeconds (%v) is below %d: the worker's stop budget is %v s (in-flight deliveries min(config.shutdownGraceSeconds, config.deliveryTimeoutSeconds) + ack flush max(5, min(config.shutdownGraceSeconds, 30)) + pool close 5) and 5 s are added for the signal and the exit; Kubernetes would kill a worker that is still draining. Leave it empty (null) or set at least %d." .Values.worker.terminationGracePeriodSeconds $minGrace (include "receipts.stopBudgetSeconds" .) $minGrace) }}
{{- end }}
{{- $floor := .Values.config.adaptiveConcurrencyFloor | int }}
{{- $ceiling := .Values.config.adaptiveConcurrencyCeiling | int }}
{{- if or (lt $floor 1) (lt $ceiling 1) }}
{{- fail "config.adaptiveConcurrencyFloor and config.adaptiveConcurrencyCeiling must be set, each at least 1 (every pod checks them at start)." }}
{{- end }}
{{- if gt $floor $ceiling }}
{{- fail (printf "config.adaptiveConcurrencyFloor (%v) must be <= config.adaptiveConcurrencyCeiling (%v): every pod would refuse to start." .Values.config.adaptiveConcurrencyFloor .Values.config.adaptiveConcurrencyCeiling) }}
{{- end }}
{{- if .Values.autoscaling.enabled }}
{{- if gt (.Values.autoscaling.minReplicas | int) (.Values.autoscaling.maxReplicas | int) }}
{{- fail (printf "autoscaling.minReplicas (%v) must be <= autoscaling.maxReplicas (%v)." .Values.autoscaling.minReplicas .Values.autoscaling.maxReplicas) }}
{{- end }}
{{- if and (eq (.Values.autoscaling.minReplicas | int) 0) (not .Values.autoscaling.keda.enabled) }}
{{- fail "autoscaling.minReplicas 0 (scale to zero) needs autoscaling.keda.enabled=true; a plain HPA cannot scale to zero." }}
{{- end }}
{{- if and .Values.autoscaling.keda.enabled $c.pgbouncer (not .Values.autoscaling.keda.poolerCompatible) }}
{{- fail "autoscaling.keda.enabled with config.pgbouncer=true: KEDA's postgresql scaler (the pgx driver) prepares and caches its statements, which a transaction pooler breaks (\"prepared statement ... does not exist\") unless it supports protocol-level prepared statements (PgBouncer 1.21+ with max_prepared_statements > 0). Point autoscaling.keda.connectionKey at a DSN that reaches PostgreSQL directly or ends in default_query_exec_mode=simple_protocol, or upgrade the pooler; then set autoscaling.keda.poolerCompatible=true." }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Install-day mistakes, each refused at render time with one message naming the value: the
image and the DSN that nothing can run without, a provider URL that is not http(s), a
schedule Kubernetes would refuse at apply time, secrets on their way into the ConfigMap, a
decimal given as text (`--set` passes "0.5" as a string) outside its range, a volume mount
without its volume. Included by receipts.validate; renders nothing.
*/}}
{{- define "receipts.validateInstall" -}}
{{- $c := .Values.config -}}
{{- if not .Values.image.repository }}
{{- fail "image.repository is required: the receipts image built from this repository's Dockerfile and pushed to your registry, e.g. --set image.repository=registry.shop.internal/receipts (image.tag defaults to the chart's appVersion)." }}
{{- end }}
{{- if regexMatch "^([^/]+\\.)?example\\.(com|net|org)(:[0-9]+)?/" .Values.image.repository }}
{{- fail (printf "image.repository %q is a documentation placeholder (example.com hosts no registry): set the repository you pushed the receipts image to." .Values.image.repository) }}
{{- end }}
{{- if and (not .Values.secret.existingSecret) (not .Values.secret.databaseUrl) }}
{{- fail (printf "secret.existingSecret or secret.databaseUrl is required: no pod of the release can start without the PostgreSQL DSN. Prefer an existing Secret holding it under the key %q (secret.databaseUrlKey), so the password stays out of values files." .Values.secret.databaseUrlKey) }}
{{- end }}
{{- if and .Values.secret.existingSecret (or .Values.secret.databaseUrl .Values.secret.providerToken) }}
{{- fail (printf "secret.existingSecret (%q) is set together with secret.%s: with an existing Secret the chart creates none, so that value would be dropped silently. Put it in the Secret %q (keys secret.databaseUrlKey %q, secret.providerTokenKey %q) and unset secret.databaseUrl and secret.providerToken, or unset secret.existingSecret." .Values.secret.existingSecret (ternary "databaseUrl" "providerToken" (not (empty .Values.secret.databaseUrl))) .Values.secret.existingSecret .Values.secret.databaseUrlKey .Values.secret.providerTokenKey) }}
{{- end }}
{{- if not $c.providerUrl }}
{{- fail "config.providerUrl is required: the receipt provider's endpoint the workers POST receipts to, e.g. --set config.providerUrl=https://receipts.provider.internal/v1/receipts." }}
{{- end }}
{{- if not (regexMatch "^[hH][tT][tT][pP][sS]?://[^/?#\\s]+" $c.providerUrl) }}
{{- fail (printf "config.providerUrl %q must be an http:// or https:// URL with a host: receipts are POSTed there." $c.providerUrl) }}
{{- end }}
{{- if regexMatch "(?i)^https?://([^/@]*@)?([^/:@]+\\.)?example\\.(com|net|org)(:[0-9]+)?([/?#]|$)" $c.providerUrl }}
{{- fail (printf "config.providerUrl %q is a documentation placeholder (example.com hosts no receipt provider): set your provider's endpoint." $c.providerUrl) }}
{{- end }}
{{- range $name, $url := dict "config.providerUrl" $c.providerUrl "config.pushgatewayUrl" $c.pushgatewayUrl "proxy.providerProxy" .Values.proxy.providerProxy "proxy.httpsProxy" .Values.proxy.httpsProxy "proxy.httpProxy" .Values.proxy.httpProxy }}
{{- if regexMatch "^[^/]*//[^/]*@" $url }}
{{- fail (printf "%s carries credentials (user:password@): it is rendered into the ConfigMap, which anyone who may read ConfigMaps in the namespace can read. Give the provider's credentials as secret.providerToken (or secret.existingSecret); put a proxy that needs a password in a Secret of your own and pass it with extraEnvFrom." $name) }}
{{- end }}
{{- end }}
{{- range $name, $url := dict "proxy.providerProxy" .Values.proxy.providerProxy "proxy.httpsProxy" .Values.proxy.httpsProxy "proxy.httpProxy" .Values.proxy.httpProxy }}
{{- if and $url (not (regexMatch "^[hH][tT][tT][pP][sS]?://[^/?#\\s]+" $url)) }}
{{- fail (printf "%s %q must be an http:// or https:// URL of the proxy (http://proxy.internal:3128)." $name $url) }}
{{- end }}
{{- end }}
{{- with .Values.alerts.runbookUrl }}
{{- if not (regexMatch "^[hH][tT][tT][pP][sS]?://[^/?#\\s]+(/[^?#\\s]*)?/$" .) }}
{{- fail (printf "alerts.runbookUrl %q must be an absolute http:// or https:// URL ending in \"/\" (e.g. https://docs.shop.internal/receipts/runbook/): Alertmanager, Grafana and PagerDuty open runbook_url as it is, and cannot resolve a relative one. Leave it empty for no runbook_url." .) }}
{{- end }}
{{- end }}
{{- if .Values.recovery.enabled }}
{{- $schedule := .Values.recovery.schedule | trim -}}
{{- $fields := regexSplit "\\s+" $schedule -1 -}}
{{- if not (or (eq (len $fields) 5) (regexMatch "^@(yearly|annually|monthly|weekly|daily|midnight|hourly)$" $schedule)) }}
{{- fail (printf "recovery.schedule %q has %d field(s): a Kubernetes CronJob schedule has 5 (minute hour day-of-month month day-of-week, e.g. \"* * * * *\") or is a macro such as @hourly. Set the time zone with recovery.timeZone, not in the schedule." $schedule (len $fields)) }}
{{- end }}
{{- end }}
{{- with .Values.recovery.timeZone }}
{{- if and $.Values.recovery.enabled (semverCompare "<1.25.0-0" $.Capabilities.KubeVersion.Version) }}
{{- fail (printf "recovery.timeZone %q needs Kubernetes 1.25 or later (CronJob timeZone); this cluster is %s, whose API server would drop the field silently. Unset it and write the schedule in the controller's time zone (UTC usually)." . $.Capabilities.KubeVersion.Version) }}
{{- end }}
{{- if not (has . ($.Files.Get "files/timezones.txt" | splitList "\n")) }}
{{- fail (printf "recovery.timeZone %q is not a time zone of the IANA database (e.g. Europe/Paris, America/New_York, UTC; names are case-sensitive, and abbreviations such as CET or PST and offsets such as UTC+1 are not names): the CronJob controller would never run the recovery." .) }}
{{- end }}
{{- end }}
{{- range $pod := list "worker" "recovery" "migration" "helmTest" "ui" }}
{{- $r := (index $.Values $pod).resources | default dict }}
{{- range $res := list "memory" "cpu" }}
{{- $req := index ($r.requests | default dict) $res }}
{{- $lim := index ($r.limits | default dict) $res }}
{{- if and $req $lim }}
{{- if lt (include "receipts.quantity" $lim | float64) (include "receipts.quantity" $req | float64) }}
{{- fail (printf "%s.resources.limits.%s (%v) is below its request (%v): Kubernetes refuses such a pod. Raise the limit or lower the request." $pod $res $lim $req) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- range $key := keys $c.extraEnv | sortAlpha }}
{{- if regexMatch "(?i)(PASSWORD|PASSWD|SECRET|TOKEN|CREDENTIAL|PRIVATE_KEY|API_KEY|DATABASE_URL|DSN)" $key }}
{{- fail (printf "config.extraEnv.%s looks like a secret: config.extraEnv is rendered into a ConfigMap, which anyone who may read ConfigMaps in the namespace can read. The DSN and the provider token go in secret.* (or secret.existingSecret); any other secret in a Secret of your own, passed with extraEnvFrom." $key) }}
{{- end }}
{{- if regexMatch "^[^/]*//[^/@\\s]*:[^/@\\s]*@" (toString (index $c.extraEnv $key)) }}
{{- fail (printf "config.extraEnv.%s holds a URL with a password: config.extraEnv is rendered into a ConfigMap. Put it in a Secret of your own and pass it with extraEnvFrom." $key) }}
{{- end }}
{{- end }}
{{- /* name, value, lower bound, lower bound excluded, upper bound (0: none) */}}
{{- $a := .Values.alerts -}}
{{- range $check := list
      (list "config.deliveryTimeoutSeconds" $c.deliveryTimeoutSeconds 0.0 true 0.0)
      (list "config.pollIntervalSeconds" $c.pollIntervalSeconds 0.0 true 0.0)
      (list "config.retryBaseSeconds" $c.retryBaseSeconds 0.0 true 0.0)
      (list "config.retryCapSeconds" $c.retryCapSeconds 0.0 true 0.0)
      (list "config.queueStatsIntervalSeconds" $c.queueStatsIntervalSeconds 1.0 false 3600.0)
      (list "autoscaling.keda.utilisation" .Values.autoscaling.keda.utilisation 0.0 true 1.0)
      (list "alerts.queueLagSeconds" $a.queueLagSeconds 0.0 true 0.0)
      (list "alerts.undeliveredAgeSeconds" $a.undeliveredAgeSeconds 0.0 true 0.0)
      (list "alerts.failureRatio" $a.failureRatio 0.0 true 1.0)
      (list "alerts.staleAckRatio" $a.staleAckRatio 0.0 true 1.0)
      (list "alerts.queueStatsMaxAgeSeconds" $a.queueStatsMaxAgeSeconds 0.0 true 0.0)
      (list "alerts.recoveryMaxAgeSeconds" $a.recoveryMaxAgeSeconds 0.0 true 0.0)
      (list "alerts.longTransactionSeconds" $a.longTransactionSeconds 0.0 true 0.0)
      (list "alerts.pruningBehindSeconds" $a.pruningBehindSeconds 0.0 true 0.0) }}
{{- $v := index $check 1 | float64 -}}
{{- $low := index $check 2 -}}
{{- $high := index $check 4 -}}
{{- if or (lt $v $low) (and (index $check 3) (eq $v $low)) (and (gt $high 0.0) (gt $v $high)) }}
{{- fail (printf "%s is %v: it must be %s %v%s." (index $check 0) (index $check 1) (ternary "above" "at least" (index $check 3)) $low (ternary (printf " and at most %v" $high) "" (gt $high 0.0))) }}
{{- end }}
{{- end }}
{{- $volumes := list "tmp" -}}
{{- range .Values.extraVolumes }}{{ $volumes = append $volumes .name }}{{ end -}}
{{- range .Values.extraVolumeMounts }}
{{- if not (has .name $volumes) }}
{{- fail (printf "extraVolumeMounts mounts %q, which is not in extraVolumes (%s)." .name (join ", " (rest $volumes))) }}
{{- end }}
{{- if eq (clean .mountPath) "/tmp" }}
{{- fail "extraVolumeMounts cannot mount /tmp: the chart mounts its own writable /tmp there (tmpSizeLimit)." }}
{{- end }}
{{- end }}
{{- end }}

{{/*
PromQL label matchers of this service's series.
*/}}
{{- define "receipts.alertSelector" -}}
{{- default (printf "job=\"%s\"" (include "receipts.fullname" .)) .Values.alerts.selector }}
{{- end }}

{{/*
A pod's volumes: the writable /tmp (the root filesystem is read-only), then extraVolumes.
*/}}
{{- define "receipts.volumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
A container's volume mounts: /tmp, then extraVolumeMounts.
*/}}
{{- define "receipts.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
A container's envFrom: the release's ConfigMap (unless "configMap" is false, as in the
migration hook, which runs before it exists), then extraEnvFrom. Pass a dict with "ctx"
(root) and "configMap". Renders nothing when the list would be empty.
*/}}
{{- define "receipts.envFrom" -}}
{{- if or .configMap .ctx.Values.extraEnvFrom }}
envFrom:
{{- if .configMap }}
  - configMapRef:
      name: {{ include "receipts.fullname" .ctx }}
{{- end }}
{{- with .ctx.Values.extraEnvFrom }}
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Settings every pod of the chart shares (its serviceAccountName is each template's: the
migration hook runs before the chart's ServiceAccount exists): no service links (Kubernetes would otherwise put a
*_SERVICE_HOST/*_PORT variable for every Service of the namespace into each container,
some of them RECEIPTS_*), no API token, the pod securityContext, the pull secrets.
*/}}
{{- define "receipts.podCommon" -}}
automountServiceAccountToken: false
enableServiceLinks: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}

{{/*
The TCP port of an http(s) URL: its explicit port, else 443 for https and 80 for http.
*/}}
{{- define "receipts.urlPort" -}}
{{- $url := urlParse . -}}
{{- $hostport := splitList ":" (regexReplaceAll "^\\[.*\\]" $url.host "") -}}
{{- if gt (len $hostport) 1 -}}
{{- last $hostport | int -}}
{{- else -}}
{{- ternary 443 80 (eq (lower $url.scheme) "https") -}}
{{- end -}}
{{- end }}

{{/*
The pod of `kubectl run … --override-type=strategic --overrides=…` that NOTES.txt gives for
`receipts jobs`: the workers' settings (ConfigMap, extraEnvFrom, the DSN from the Secret),
security contexts, /tmp and extraVolumes, and the release's labels so that its
NetworkPolicy lets it reach the database. One line of JSON.
*/}}
{{- define "receipts.jobsPodOverrides" -}}
{{- $name := include "receipts.componentName" (dict "ctx" . "suffix" "jobs" "max" 63) -}}
{{- $envFrom := concat (list (dict "configMapRef" (dict "name" (include "receipts.fullname" .)))) .Values.extraEnvFrom -}}
{{- $env := list (dict "name" "RECEIPTS_DATABASE_URL" "valueFrom" (dict "secretKeyRef" (dict "name" (include "receipts.secretName" .) "key" .Values.secret.databaseUrlKey))) -}}
{{- $container := dict "name" $name "envFrom" $envFrom "env" $env "securityContext" .Values.securityContext "volumeMounts" (include "receipts.volumeMounts" . | fromYamlArray) -}}
{{- $labels := merge (dict "app.kubernetes.io/component" "jobs") (include "receipts.selectorLabels" . | fromYaml) -}}
{{- $spec := dict "containers" (list $container) "enableServiceLinks" false "automountServiceAccountToken" false "securityContext" .Values.podSecurityContext "volumes" (include "receipts.volumes" . | fromYamlArray) -}}
{{- with .Values.imagePullSecrets }}{{ $_ := set $spec "imagePullSecrets" . }}{{ end -}}
{{- dict "metadata" (dict "labels" $labels) "spec" $spec | toJson -}}
{{- end }}
