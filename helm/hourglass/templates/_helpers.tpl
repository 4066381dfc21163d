{{/* Names, labels and shared snippets of the Hourglass chart. */}}

{{- define "hourglass.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* release-scoped prefix; kept short enough that every StatefulSet name stays <= 52 characters (30 + "-realtime-" + a 12-character group name) */}}
{{- define "hourglass.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 30 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 30 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 30 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "hourglass.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "hourglass.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hourglass.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "hourglass.labels" -}}
helm.sh/chart: {{ include "hourglass.chart" . }}
{{ include "hourglass.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: hourglass
{{- end -}}

{{- define "hourglass.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "hourglass.svcDomain" -}}
{{- printf "%s.svc.%s" .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{- define "hourglass.metaserverName" -}}
{{- printf "%s-metaserver" (include "hourglass.fullname" .) -}}
{{- end -}}

{{/* what nodes and clients bootstrap from: the meta server Service, as host:port */}}
{{- define "hourglass.metaserverAddress" -}}
{{- printf "%s.%s:%d" (include "hourglass.metaserverName" .) (include "hourglass.svcDomain" .) (int .Values.metaserver.port) -}}
{{- end -}}

{{- define "hourglass.etcdName" -}}
{{- printf "%s-etcd" (include "hourglass.fullname" .) -}}
{{- end -}}

{{/* comma-separated etcd client endpoints (host:port) for the meta servers, which fail over between them */}}
{{- define "hourglass.etcdEndpoints" -}}
{{- if .Values.etcd.bundled -}}
{{- $name := include "hourglass.etcdName" . -}}
{{- $out := list -}}
{{- range $i := until (int .Values.etcd.replicas) -}}
{{- $out = append $out (printf "%s-%d.%s-headless.%s:%d" $name $i $name (include "hourglass.svcDomain" $) (int $.Values.etcd.clientPort)) -}}
{{- end -}}
{{- join "," $out -}}
{{- else -}}
{{- if not .Values.etcd.externalEndpoints -}}
{{- fail "etcd.bundled is false: set etcd.externalEndpoints to the client endpoints (host:port) of your etcd cluster" -}}
{{- end -}}
{{- $out := list -}}
{{- range .Values.etcd.externalEndpoints -}}
{{- $out = append $out (trimPrefix "http://" . | trimSuffix "/") -}}
{{- end -}}
{{- join "," $out -}}
{{- end -}}
{{- end -}}

{{/* pod anti-affinity over the pods matching (dict "root" $ "labels" $selector) */}}
{{- define "hourglass.antiAffinity" -}}
{{- $root := .root -}}
{{- if eq $root.Values.antiAffinity "hard" }}
podAntiAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: {{ $root.Values.antiAffinityTopologyKey }}
      labelSelector:
        matchLabels:
          {{- toYaml .labels | nindent 10 }}
{{- else if eq $root.Values.antiAffinity "soft" }}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: {{ $root.Values.antiAffinityTopologyKey }}
        labelSelector:
          matchLabels:
            {{- toYaml .labels | nindent 12 }}
{{- end -}}
{{- end -}}

{{/* checks across values that a JSON schema cannot express */}}
{{- define "hourglass.validate" -}}
{{- $seen := dict -}}
{{- range $role, $groups := dict "delay" .Values.delayGroups "realtime" .Values.realtimeGroups -}}
{{- range $groups -}}
{{- $key := printf "%s/%s" $role .name -}}
{{- if hasKey $seen $key -}}
{{- fail (printf "%sGroups: group name %q appears twice; every group needs its own name" $role .name) -}}
{{- end -}}
{{- $_ := set $seen $key true -}}
{{- $ack := default $.Values.nodes.ackMode .ackMode -}}
{{- if and (eq $ack "sync") (lt (int .replicas) 2) -}}
{{- fail (printf "%sGroups[%s]: ackMode sync waits for a slave, so replicas must be at least 2 (got %d)" $role .name (int .replicas)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
